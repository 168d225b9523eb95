"""Specs: what a model and a machine are, before any cost.

Modules: :mod:`~tessera.spec.model` (``ModelSpec``, ``LayerSpec`` and the mixer / MLP specs),
:mod:`~tessera.spec.presets` (``MODEL_PRESETS``, ``get_model``), :mod:`~tessera.spec.hf` (specs
from Hugging Face configs), :mod:`~tessera.spec.params` (parameter counts),
:mod:`~tessera.spec.hardware` / :mod:`~tessera.spec.hardware_presets` (``HardwareSpec``,
``get_hardware``), and :mod:`~tessera.spec.tasks`: the task split of a layer spec
(``Phase``, ``Resource``, ``TaskKind``, ``TaskShape``, ``layer_shapes``, ``block_shapes``), the one
definition of each layer's tasks that the cost sources and the cost-free task structure share.
"""
