"""The ``torch.distributed.checkpoint`` transport of :func:`tessera.train.upgrade.reshard.move_state`.

Each member saves the entries other members need (flattened keys ``<global name>/<key>``, e.g.
``layers.3.attn.out_proj.weight/param``, ``.../exp_avg``) into the group's scratch directory with
one collective ``dcp.save``; then every member loads the keys it needs with one collective
``dcp.load`` into tensors allocated from the exchanged metadata. The members hold different key
sets (pipeline parallel: each holds its own layers); DCP merges the members' save plans into
one metadata file, and a load asks only for keys that exist there.
"""

from __future__ import annotations

import torch

from tessera.train.upgrade.entries import PARAM, dtype_of, signature


def flat_key(name: str, key: str) -> str:
    """The DCP key of entry ``key`` (``"param"``, ``"exp_avg"``, ...) of parameter ``name``."""
    return f"{name}/{key}"


def exchange_dcp(held, send, recv, sig, group, scratch_dir, devices) -> dict[str, dict[str, torch.Tensor]]:
    """Save ``send``'s entries and load ``recv``'s through DCP files in ``scratch_dir``.

    Args:
        held: this rank's named state; send: ``{dst: names}``; recv: ``{src: names}``.
        sig: ``{name: signature}`` of the received names (the sender's).
        group: the pipeline process group (DCP's ``process_group``; coordinator: group rank 0).
        scratch_dir: directory shared by the group's members (overwritten).
        devices: ``{name: device}`` of the new parameters (``step`` loads to the CPU).

    Returns:
        ``{name: {key: tensor}}`` of the received names (fresh tensors).
    """
    import torch.distributed.checkpoint as dcp

    out_state = {flat_key(n, key): held[n][key].detach()
                 for names in send.values() for n in names for key, _, _ in signature(held[n])}
    dcp.save(out_state, storage_writer=dcp.FileSystemWriter(str(scratch_dir)), process_group=group)
    got: dict[str, dict[str, torch.Tensor]] = {}
    in_state = {}
    for names in recv.values():
        for n in names:
            entry = {}
            for key, dt, sh in sig[n]:
                device = devices[n] if key == PARAM or len(sh) else torch.device("cpu")
                entry[key] = in_state[flat_key(n, key)] = torch.empty(sh, dtype=dtype_of(dt), device=device)
            got[n] = entry
    dcp.load(in_state, storage_reader=dcp.FileSystemReader(str(scratch_dir)), process_group=group)
    return got
