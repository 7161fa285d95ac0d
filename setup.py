"""Generates the gRPC stubs from protos/*.proto whenever the package is built or installed.

The stubs are build outputs (git-ignored), so `pip install .` and `pip install -e .` both run
protoc; nothing generated is committed.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def generate_stubs() -> None:
    from grpc_tools import protoc  # build-time requirement, see pyproject.toml

    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
