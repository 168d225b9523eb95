"""Tessera: pipeline-parallel training for heterogeneous MoE models.

Data flows one way: Recipe -> ModelSpec/HardwareSpec -> ModelCosts -> Plan -> Programs ->
simulator or engine. Every value passed between modules is a frozen dataclass that
serialises to JSON.
"""

__version__ = "0.1.0"
