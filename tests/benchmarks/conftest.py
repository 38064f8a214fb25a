import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def load_script():
    """load_script("name") -> benchmarks/name.py imported as a module (the folder is not a package)."""

    def load(name: str):
        if str(BENCHMARKS) not in sys.path:  # as `python benchmarks/X.py` has it: siblings import (bench_env)
            sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
