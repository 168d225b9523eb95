"""What activation recompute drops and re-runs in the executable model (``planner.activation_recompute``).

:class:`Recompute` is the plain value a :class:`~tessera.model.stage.StageModule` is built with
(mode ``none`` | ``selective`` | ``full`` and, for ``selective``, Megatron-Core
``--recompute-modules`` names, :data:`tessera.cost.types.RECOMPUTE_MODULES`);
:meth:`Recompute.plan` turns it into one layer's :class:`LayerRecompute`: which task forwards
run as a whole checkpoint and which smaller regions do. The mechanisms are in
:mod:`tessera.model.regions`.

What each mode does per task (the engine's F/B/W split; names of :mod:`tessera.model.tasks`):

* ``full``: the forward of every compute task of a decoder layer (``mixer``, ``router``,
  ``shared``, ``expert``, ``mlp``) is one non-reentrant ``torch.utils.checkpoint``: its inputs
  stay, everything it saved inside is dropped and rebuilt at the start of the task's B. The
  communication tasks re-run nothing: ``dispatch``'s gather and ``combine``'s weighted sum
  save only index tensors and their input rows (which the all-to-all delivered and the engine
  holds anyway), so no all-to-all is ever issued again. The head and the embedding are never
  recomputed (as :func:`tessera.cost.memory.head_activation` assumes).
* ``selective`` (per module, :func:`tessera.cost.memory.recompute_ops`):
  ``core_attn``: the attention core (``QK^T``, softmax, ``PV``) of attention and MLA mixers, a
  checkpoint over Q, K, V; ``layernorm``: the input norm (mixer) and the pre-MLP norm (router /
  dense MLP) as output-discarding regions (their outputs, the first GEMMs' inputs, and their
  FP32 internals are rebuilt from the norm input); ``moe_act``: each routed expert's activation
  ``act(gate(x)) * up(x)`` (or ``relu(up(x))**2``) output-discarding, the fc2 input rebuilt from
  fc1's outputs; ``mlp``: the dense MLP task whole; ``moe``: the router after its norm, the
  shared expert and the expert task whole; ``shared_experts``: the shared-expert task whole;
  ``mla_up_proj``: an MLA mixer's up-projections and RoPE as an output-discarding region
  (:meth:`tessera.model.mixers.Mixer.run_mla_up_proj`: Q, K, V rebuilt from the normed
  latents; with ``core_attn`` as well, one checkpoint over both). A region inside a task that is
  already checkpointed whole is not added again.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.cost.types import RECOMPUTE_MODES, RECOMPUTE_MODULES, CostOptions
from tessera.errors import TesseraConfigError
from tessera.spec.model import AttentionSpec, DenseMLPSpec, LayerSpec, MLASpec, MoESpec


@dataclass(frozen=True)
class LayerRecompute:
    """The recompute regions of one decoder layer (all False: nothing is recomputed).

    Whole tasks: ``mixer``, ``router``, ``shared``, ``expert``, ``mlp`` (the task's forward is one
    checkpoint). Regions: ``core_attn`` (attention core), ``input_norm`` / ``post_norm``
    (output-discarding norms), ``gating`` (the router after its norm), ``moe_act`` (routed
    experts' activation, output-discarding), ``mla_up_proj`` (MLA up-projections and RoPE,
    output-discarding)."""

    mixer: bool = False
    router: bool = False
    shared: bool = False
    expert: bool = False
    mlp: bool = False
    core_attn: bool = False
    input_norm: bool = False
    post_norm: bool = False
    gating: bool = False
    moe_act: bool = False
    mla_up_proj: bool = False

    @property
    def any(self) -> bool:
        return any(getattr(self, f) for f in self.__dataclass_fields__)


NO_RECOMPUTE = LayerRecompute()


@dataclass(frozen=True)
class Recompute:
    """``planner.activation_recompute`` and ``recompute_modules`` as the model takes them.

    Attributes:
        mode: ``none`` | ``selective`` | ``full``.
        modules: for ``selective``, Megatron-Core ``--recompute-modules`` names (ignored otherwise).

    Raises:
        TesseraConfigError: an unknown mode or module, or ``selective`` without modules.
    """

    mode: str = "none"
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in RECOMPUTE_MODES:
            raise TesseraConfigError("planner.activation_recompute", self.mode, "is not a recompute mode",
                                     f"use one of {', '.join(RECOMPUTE_MODES)}")
        object.__setattr__(self, "modules", tuple(self.modules))
        bad = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        if bad:
            raise TesseraConfigError("planner.recompute_modules", list(self.modules), f"names unknown modules {bad}",
                                     f"use some of {', '.join(RECOMPUTE_MODULES)}")
        if self.mode == "selective" and not self.modules:
            raise TesseraConfigError("planner.recompute_modules", [], "selective recompute needs at least one module",
                                     "name the modules, e.g. [core_attn], or use activation_recompute=none")

    @staticmethod
    def of(mode, modules=("core_attn",)) -> "Recompute":
        """From the recipe's values: ``mode`` a mode name or a boolean (True: full, False: none,
        the older spelling); ``modules`` kept only for ``selective``."""
        mode = CostOptions.recompute_mode(mode)
        return Recompute(mode, tuple(modules) if mode == "selective" else ())

    def plan(self, layer: LayerSpec) -> LayerRecompute:
        """The regions of ``layer`` under this mode (module docstring)."""
        if self.mode == "none":
            return NO_RECOMPUTE
        is_moe, has_mixer = isinstance(layer.mlp, MoESpec), layer.mixer is not None
        dense = isinstance(layer.mlp, DenseMLPSpec)
        shared = is_moe and bool(layer.mlp.shared_expert_ffn)
        if self.mode == "full":
            return LayerRecompute(mixer=has_mixer, router=is_moe, shared=shared, expert=is_moe, mlp=dense)
        mods = set(self.modules)
        moe = is_moe and "moe" in mods
        mlp = dense and "mlp" in mods
        expert = moe
        return LayerRecompute(
            shared=shared and (moe or "shared_experts" in mods), expert=expert, mlp=mlp,
            core_attn=isinstance(layer.mixer, (AttentionSpec, MLASpec)) and "core_attn" in mods,
            input_norm=has_mixer and "layernorm" in mods,
            post_norm=(is_moe or (dense and not mlp)) and "layernorm" in mods,
            gating=moe, moe_act=is_moe and not expert and "moe_act" in mods,
            mla_up_proj=isinstance(layer.mixer, MLASpec) and "mla_up_proj" in mods)
