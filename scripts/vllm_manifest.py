"""Read a vLLM source tree, without importing it, into the JSON manifest vexact-vllm is checked against.

    python scripts/vllm_manifest.py PATH/TO/vllm [--out tests/vexact_vllm/data]

PATH/TO/vllm is the `vllm` package directory (an installed one, `.venv/lib/python3.11/site-packages/vllm`,
or one extracted from a wheel). It writes `vllm-<version>.json` with:
- "version": from `vllm/_version.py`;
- "symbols": for every vLLM name vexact-vllm relies on, what the tree defines there (null: nothing):
  {"kind": "function", "params": [...]} (as written: `self`/`cls` included), "property", "class",
  "value" (an assignment, a dataclass field, an instance attribute set in a method) or "module". The names are
  every patch-table target (vexact_vllm/vllm_patches.py, optional rows included), every
  `from vllm... import NAME` in the plugin's sources, and `RELIED_ON` below (attributes of vLLM
  classes the plugin subclasses or reads);
- "sampling_params_fields", "engine_args_fields", "async_engine_args_fields": the annotated fields of
  `SamplingParams` (a msgspec Struct), `EngineArgs` and `AsyncEngineArgs` (dataclasses), in order.

Names resolve as Python would resolve them statically: a module's top-level definitions and imports
(also under `if TYPE_CHECKING:` / `try:`), star imports, and class bases for attributes. The tests
(tests/vexact_vllm/test_manifests.py) check the plugin against the committed manifests and check that
this script reproduces the installed vLLM's manifest, and that its answers agree with `inspect`.
Running it needs the plugin importable (for the patch table), not the vLLM it reads.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = ("vexact_vllm", "kernels", "model_patches")  # the installed package's directories
DATA = ROOT / "tests" / "vexact_vllm" / "data"

RELIED_ON = (
    # runner v2: the sampler and model state the vexact ones subclass (vexact_vllm/sampler/v2.py)
    "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
    "vllm.v1.worker.gpu.sample.sampler:Sampler.sampling_states",
    "vllm.v1.worker.gpu.sample.sampler:Sampler.logprob_token_ids_state",
    "vllm.v1.worker.gpu.sample.sampler:Sampler.req_states",
    "vllm.v1.worker.gpu.sample.sampler:Sampler.compute_nans",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.temperature",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.seeds",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.top_k",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.top_p",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.min_p",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.max_num_reqs",
    "vllm.v1.worker.gpu.sample.states:SamplingStates.max_num_logprobs",
    "vllm.v1.worker.gpu.sample.logprob:LogprobTokenIdsState.max_num_token_ids",
    "vllm.v1.worker.gpu.model_states.default:DefaultModelState.custom_sampler",
    "vllm.v1.worker.gpu.input_batch:InputBatch.expanded_idx_mapping",
    "vllm.v1.worker.gpu.input_batch:InputBatch.idx_mapping_np",
    "vllm.v1.worker.gpu.input_batch:InputBatch.positions",
    "vllm.v1.worker.gpu.input_batch:InputBatch.logits_indices",
    "vllm.v1.worker.gpu.input_batch:InputBatch.cu_num_logits_np",
    "vllm.v1.worker.gpu.input_batch:InputBatch.seq_lens",
    "vllm.v1.worker.gpu.input_batch:InputBatch.num_reqs",
    # vLLM's copies of transformers' configs, for which the training switch registers its classes too
    # (model_patches/trainers/transformers_hooks.py, read in the plugin's register())
    "vllm.transformers_utils.config:_CONFIG_REGISTRY",
    # the V1 runner's sampler (vexact_vllm/sampler/v1.py)
    "vllm.v1.sample.sampler:Sampler.forward",
    "vllm.v1.sample.sampler:Sampler.gather_logprobs",
    # the attention backend (vexact_vllm/attention.py)
    "vllm.v1.attention.backend:AttentionBackend.get_name",
    "vllm.v1.attention.backend:AttentionBackend.get_impl_cls",
    "vllm.v1.attention.backend:AttentionBackend.get_builder_cls",
    "vllm.v1.attention.backend:AttentionBackend.get_supported_head_sizes",
    "vllm.v1.attention.backend:AttentionBackend.supports_attn_type",
    "vllm.v1.attention.backend:AttentionMetadataBuilder.build",
    "vllm.v1.attention.backend:AttentionImpl.forward",
    "vllm.v1.attention.backend:CommonAttentionMetadata.query_start_loc",
    "vllm.v1.attention.backend:CommonAttentionMetadata.seq_lens",
    "vllm.v1.attention.backend:CommonAttentionMetadata.num_reqs",
    "vllm.v1.attention.backend:CommonAttentionMetadata.num_actual_tokens",
    "vllm.v1.attention.backend:CommonAttentionMetadata.max_query_len",
    "vllm.v1.attention.backend:CommonAttentionMetadata.block_table_tensor",
    "vllm.v1.attention.backend:CommonAttentionMetadata.slot_mapping",
    "vllm.v1.attention.backend:CommonAttentionMetadata.causal",
    # the config hooks, the runner choice and the environment read (vexact_vllm/engine_checks.py,
    # request_validation.py, option_policy.py)
    "vllm.model_executor.models.config:VerifyAndUpdateConfig.verify_and_update_model_config",
    "vllm.model_executor.models.config:VerifyAndUpdateConfig.verify_and_update_config",
    "vllm.config.vllm:VllmConfig.use_v2_model_runner",
    "vllm.envs:VLLM_BATCH_INVARIANT",
    # one position per token for Qwen3.5's configs (engine_checks.text_positions, the model's post-condition)
    "vllm.config.model:ModelConfig.uses_mrope",
    "vllm.config.model:ModelConfig.hf_text_config",
)


class Tree:
    """A vLLM package directory, read with `ast` (no import)."""

    def __init__(self, package_dir: Path):
        self.package_dir = Path(package_dir)
        self.base = self.package_dir.parent  # "vllm.x.y" -> base/vllm/x/y(.py | /__init__.py)
        self._trees: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> Path | None:
        path = self.base.joinpath(*module.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = None if path is None else ast.parse(path.read_text(), str(path))
        return self._trees[module]

    def version(self) -> str:
        for node in ast.walk(self.tree("vllm._version")):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
                return node.value.value
        raise ValueError(f"no __version__ in {self.package_dir}/_version.py")

    # --- names ------------------------------------------------------------------------------------

    def find(self, module: str, name: str, seen=None):
        """(kind, node, module) of `name` in `module` (its top-level definitions and imports), or None."""
        seen = set() if seen is None else seen
        if (module, name) in seen:
            return None
        seen.add((module, name))
        tree = self.tree(module)
        if tree is None:
            return None
        stars = []
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return "function", node, module
            if isinstance(node, ast.ClassDef) and node.name == name:
                return "class", node, module
            if isinstance(node, ast.Assign) and any(_binds(t, name) for t in node.targets):
                return "value", node, module
            if isinstance(node, ast.AnnAssign) and _binds(node.target, name):
                return "value", node, module
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, self.file(module))
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        found = self.find(source, alias.name, seen)
                        if found is None and self.file(f"{source}.{alias.name}"):
                            return "module", None, f"{source}.{alias.name}"
                        return found
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        return ("module", None, alias.name) if self.file(alias.name) else None
        for source in stars:
            found = self.find(source, name, seen)
            if found is not None:
                return found
        if self.file(f"{module}.{name}"):
            return "module", None, f"{module}.{name}"
        return None

    def member(self, cls_node: ast.ClassDef, module: str, name: str, seen=None):
        """(kind, node) of attribute `name` of a class: its body, attributes set on self in its methods,
        then its bases (resolved in the class's module)."""
        seen = set() if seen is None else seen
        if (module, cls_node.name) in seen:
            return None
        seen.add((module, cls_node.name))
        for node in _top_level(cls_node.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return "function", node
            if isinstance(node, ast.Assign) and any(_binds(t, name) for t in node.targets):
                return "value", node
            if isinstance(node, ast.AnnAssign) and _binds(node.target, name):
                return "value", node
        for method in cls_node.body:
            if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(method):
                    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                    if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(_self_attr(t, name) for t in targets):
                        return "value", node
        for base in cls_node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base  # Generic[T]
            if isinstance(base, ast.Name):
                found = self.find(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                owner = self.find(module, base.value.id)
                found = self.find(owner[2], base.attr) if owner and owner[0] == "module" else None
            else:
                found = None
            if found is not None and found[0] == "class":
                hit = self.member(found[1], found[2], name, seen)
                if hit is not None:
                    return hit
        return None

    def symbol(self, target: str) -> dict | None:
        """What the tree defines at "module:Name.attr..." (the manifest's entry), or None."""
        module, _, path = target.partition(":")
        if not path:
            return {"kind": "module"} if self.file(module) else None
        first, *rest = path.split(".")
        found = self.find(module, first)
        if found is None:
            return None
        kind, node, where = found
        for part in rest:
            if kind == "class":
                hit = self.member(node, where, part)
                if hit is None:
                    return None
                kind, node = hit
            elif kind == "module":
                found = self.find(where, part)
                if found is None:
                    return None
                kind, node, where = found
            else:
                return None
        if kind == "function" and any(_name(d) in ("property", "cached_property") for d in node.decorator_list):
            return {"kind": "property"}
        if kind == "function":
            return {"kind": "function", "params": _params(node)}
        return {"kind": kind}

    def fields(self, module: str, cls: str) -> list[str]:
        """The annotated class-body fields of a dataclass or msgspec Struct (ClassVar left out)."""
        found = self.find(module, cls)
        if found is None or found[0] != "class":
            return []
        return [
            node.target.id for node in found[1].body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and "ClassVar" not in ast.unparse(node.annotation)
        ]  # fmt: skip


def _top_level(body):
    """Statements of a body, descending into `if` / `try` blocks (TYPE_CHECKING imports, fallbacks)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _top_level(block)
        else:
            yield node


def _name(node) -> str | None:
    """The last name of a decorator (`property`, `functools.cached_property`)."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _binds(target, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_binds(t, name) for t in target.elts)
    return False


def _self_attr(target, name: str) -> bool:
    return (isinstance(target, ast.Attribute) and target.attr == name and isinstance(target.value, ast.Name)
            and target.value.id == "self")  # fmt: skip


def _absolute(module: str, node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _params(node) -> list[str]:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return names


# --- what the plugin relies on ----------------------------------------------------------------------


def plugin_imports(root: Path = ROOT) -> set[str]:
    """Every "vllm.module:Name" the plugin's sources import from vLLM (and "vllm.module" for `import`)."""
    names = set()
    for directory in PLUGIN_SOURCES:
        for path in sorted((root / directory).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] == "vllm":
                    names.update(f"{node.module}:{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    names.update(a.name for a in node.names if a.name.split(".")[0] == "vllm")
    return names


def patch_targets() -> dict[str, tuple[str, ...]]:
    """Target -> expected parameters, for every row of vLLM's patch table (optional rows included)."""
    sys.path.insert(0, str(ROOT))
    from vexact_vllm import vllm_patches

    return {row.target: row.params for row in (*vllm_patches.ROWS, *vllm_patches.OPTIONAL_ROWS)}


def queries() -> list[str]:
    return sorted({*patch_targets(), *plugin_imports(), *RELIED_ON})


def manifest(package_dir: Path, names: list[str] | None = None) -> dict:
    tree = Tree(package_dir)
    names = queries() if names is None else names
    return {
        "version": tree.version(),
        "symbols": {name: tree.symbol(name) for name in names},
        "sampling_params_fields": tree.fields("vllm.sampling_params", "SamplingParams"),
        "engine_args_fields": tree.fields("vllm.engine.arg_utils", "EngineArgs"),
        "async_engine_args_fields": tree.fields("vllm.engine.arg_utils", "AsyncEngineArgs"),
    }


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package_dir", type=Path, help="the vllm package directory of a source tree")
    parser.add_argument("--out", type=Path, default=DATA, help=f"output directory (default {DATA})")
    args = parser.parse_args(argv)
    data = manifest(args.package_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"vllm-{data['version']}.json"
    path.write_text(dumps(data))
    missing = sorted(name for name, found in data["symbols"].items() if found is None)
    print(f"wrote {path}: {len(data['symbols'])} names ({len(missing)} not found: {', '.join(missing) or '-'}), "
          f"{len(data['sampling_params_fields'])} SamplingParams fields, "
          f"{len(data['engine_args_fields'])} EngineArgs fields")


if __name__ == "__main__":
    main()
