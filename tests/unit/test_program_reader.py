"""A registered program's module is read in a process of its own (controller/programs.py):
bytes that crash MLIR's native reader take that process down, not the controller; the
program is refused and the next one is read by a new reader."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from controller import programs
from slicewise.common.errors import InvalidRequestError
from slicewise.common.mesh import MeshSpec

MESH = MeshSpec.build(ici={"x": 1})


def exported() -> bytes:
    exp = jax.export.export(jax.jit(lambda a: a * 2.0))(jax.ShapeDtypeStruct((4,), jnp.float32))
    return bytes(exp.serialize())


def test_a_reader_that_dies_is_replaced_and_only_that_program_is_refused():
    try:
        assert "stablehlo" in programs.read_module(exported())
        with pytest.raises(RuntimeError, match="crashed the reader process"):
            programs.in_reader(os.abort)
        program = programs.load_program(exported(), "double", MESH)  # a new reader
        assert program.name == "double" and program.inputs[0].shape == (4,)
    finally:
        programs.stop_reader()


def test_a_crash_while_loading_is_a_clear_refusal(monkeypatch):
    def crashing(serialized: bytes) -> str:
        raise RuntimeError("reading its module crashed the reader process")

    monkeypatch.setattr(programs, "read_module", crashing)
    with pytest.raises(InvalidRequestError, match="holds no readable StableHLO module"):
        programs.load_program(exported(), "bad", MESH)
