"""The `moe` program (`slicewise train moe`) and its Mixture-of-Experts layer
(`programs.moe.layer`, sharded in `programs.moe.sharded`)."""

from programs.moe.config import MoEConfig
from programs.moe.program import MoEProgram

PROGRAM = MoEProgram()

__all__ = ["PROGRAM", "MoEConfig", "MoEProgram"]
