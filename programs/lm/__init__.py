"""The `lm` program: a small byte-level decoder-only transformer (`slicewise train lm`)."""

from programs.lm.config import LMConfig
from programs.lm.program import LMProgram

PROGRAM = LMProgram()

__all__ = ["PROGRAM", "LMConfig", "LMProgram"]
