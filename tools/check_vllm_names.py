"""Check every vLLM name fold uses against a vLLM wheel (or an unpacked source tree), without importing vLLM.

    python -m tools.check_vllm_names /work/vllm-wheels/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python -m tools.check_vllm_names .venv-vllm/lib/python3.11/site-packages      # an installed tree
    python -m tools.check_vllm_names WHEEL --out results/tools/vllm-names-0.33.0.txt

Everything is read with ``ast`` (stdlib only; this script imports neither vllm, torch nor fold). Sections:

- version gate: ``TESTED`` in fold/vllm/compat.py against the tree's version;
- imports: every ``import vllm...`` / ``from vllm... import X`` in fold/ (inside try/except and functions too);
- drafters: ``DRAFTERS`` / ``NOT_COVERED`` of compat.py against the model files and the model registry;
- drafter layers: what ``models.install`` reads off each drafter's attention modules (:data:`LAYERS`);
- required: :data:`REQUIRED`, the duck-typed attributes no import shows;
- rotary embedding: every ``rotary_emb.X`` that fold/vllm/models.py reads or calls, per class where it
  branches on ``type(rotary_emb).__name__``;
- attribute accesses on names bound to vLLM objects (``AttentionType.DECODER``);
- overrides: the methods and class attributes fold's subclasses of vLLM classes define, and abstract methods;
- call sites: vLLM's calls into fold's methods (:data:`CALL_SITES`) and fold's calls into vLLM.

One line per check: ``ok`` / ``MISSING`` / ``moved to <module>`` / ``DIFF`` (a signature or an entry
changed: read it) / ``BREAKS`` (a call cannot bind, or ``TESTED`` refuses this version) / ``ABSTRACT`` (a
base-class abstract method fold does not define) / ``info``. Exit 1 on any MISSING, moved, BREAKS or
ABSTRACT line; an absent optional import (guarded by ``except ImportError``) is a lower-case ``missing``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import os
import re
import sys
import zipfile
from pathlib import Path

BACKEND = "vllm.v1.attention.backend"
BACKENDS = "vllm.v1.attention.backends"
LAYER = "vllm.model_executor.layers.attention.attention"
ROPE = "vllm.model_executor.layers.rotary_embedding"
MODELS = "vllm.model_executor.models"
CONFIG = "vllm.config"

# What fold relies on that no import shows: (module, class, attribute, kind, reason). kind: "field" = a
# class-body annotation; "method" = a def; "member" = anything the class or its bases bind (class
# attribute, method, annotation, self.X, register_buffer); "assigned" = set as ``obj.X = ...`` somewhere
# in the class's module (vLLM's helpers set the layer's FP8 scales so); "name" = a module-level name (in
# the class column). A class not bound in its module is looked for in the modules under it.
REQUIRED = [
    # backend.FoldMetadataBuilder.build
    (BACKEND, "CommonAttentionMetadata", "num_actual_tokens", "field", "build(): tokens in the batch"),
    (BACKEND, "CommonAttentionMetadata", "num_reqs", "field", "build(): requests in the batch"),
    (BACKEND, "CommonAttentionMetadata", "max_query_len", "field", "build(): n_q of a uniform drafting round"),
    (BACKEND, "CommonAttentionMetadata", "query_start_loc", "field", "build(): device query offsets"),
    (BACKEND, "CommonAttentionMetadata", "query_start_loc_cpu", "field", "forward(): split of a non-uniform batch"),
    (BACKEND, "CommonAttentionMetadata", "seq_lens", "field", "build(): entries per request, the block's own included"),
    (BACKEND, "CommonAttentionMetadata", "block_table_tensor", "field", "build(): the pages of each request"),
    (BACKEND, "CommonAttentionMetadata", "slot_mapping", "field", "build(): kept on FoldMetadata"),
    (BACKEND, "CommonAttentionMetadata", "causal", "field",
     "build(): passed through as given (bool or tensor); the DFlash proposer checks the metadata's causal"),
    # what FoldMetadataBuilder declares and defines: the base must have the same names for vLLM to read them
    # FoldAttentionBackend declares it True: vLLM hands a forward's keys to forward(), where the block's
    # positions are known, instead of writing them through do_kv_cache_update (the cache holds them un-rotated)
    (BACKEND, "AttentionBackend", "forward_includes_kv_cache_update", "member",
     "the layer reads attn_backend's flag to choose who writes the keys"),
    (BACKEND, "AttentionMetadataBuilder", "_cudagraph_support", "member",
     "fold declares UNIFORM_BATCH; get_cudagraph_support returns it"),
    (BACKEND, "AttentionCGSupport", "UNIFORM_BATCH", "member", "fold's _cudagraph_support"),
    (BACKEND, "AttentionMetadataBuilder", "get_cudagraph_support", "method", "what get_attn_cg_support asks"),
    (BACKEND, "AttentionMetadataBuilder", "supports_draft_decode_metadata_update", "member",
     "fold declares True: V2 keeps the metadata across draft steps"),
    (BACKEND, "AttentionMetadataBuilder", "update_draft_decode_metadata", "method",
     "fold defines it (a no-op): V2 calls it between draft steps"),
    (BACKEND, "AttentionMetadataBuilder", "supports_update_block_table", "member", "default False, kept by fold"),
    (BACKEND, "AttentionMetadataBuilder", "build_for_cudagraph_capture", "method", "default calls build()"),
    (BACKEND, "AttentionMetadataBuilder", "build_for_drafting", "v1-method",
     "V1 proposer; default calls build() (0.34 has no V1 runner, and V2 calls build() itself)"),
    ("vllm.v1.worker.utils", "AttentionGroup", "supports_draft_decode_metadata_update", "member",
     "V2 reads the builder's flag per group"),
    ("vllm.v1.worker.gpu.attn_utils", "get_attn_cg_support", None, "name", "V2: min CUDA-graph support"),
    # models.install: the stock impl vLLM built, read before fold replaces it
    (BACKEND, "AttentionImplBase", "num_heads", "member", "install(): FoldAttentionImpl(impl.num_heads, ...)"),
    (BACKEND, "AttentionImplBase", "head_size", "member", "install(): impl.head_size"),
    (BACKEND, "AttentionImplBase", "scale", "member", "install(): impl.scale is fold's softmax_scale"),
    (f"{BACKENDS}.flash_attn", "FlashAttentionImpl", "num_kv_heads", "member", "install(): impl.num_kv_heads"),
    (f"{BACKENDS}.flashinfer", "FlashInferImpl", "num_kv_heads", "member", "install(): impl.num_kv_heads"),
    (f"{BACKENDS}.flex_attention", "FlexAttentionImpl", "num_kv_heads", "member", "install(): impl.num_kv_heads"),
    (f"{BACKENDS}.triton_attn", "TritonAttentionImpl", "num_kv_heads", "member", "install(): impl.num_kv_heads"),
    (f"{BACKENDS}.cpu_attn", "CPUAttentionBackendImpl", "num_kv_heads", "member", "install(): impl.num_kv_heads (CPU)"),
    # models.install: the Attention layer fold re-points at its backend; backend.FoldAttentionImpl.scales
    (LAYER, "Attention", "impl", "member", "install(): attn.impl is read and replaced"),
    (LAYER, "Attention", "attn_backend", "member", "install(): attn.attn_backend = FoldAttentionBackend"),
    (LAYER, "Attention", "backend", "member", "install(): attn.backend = AttentionBackendEnum['FOLD']"),
    (LAYER, "Attention", "kv_cache_dtype", "member", "install(): the cache dtype fold's impl reads and writes"),
    (LAYER, "Attention", "sliding_window", "member", "install(): a layer's window where the module keeps none; then "
     "set to None, so a sliding layer gets a full cache"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl", "sinks", "member",
     "install(): a layer's sinks where the module keeps them under another name (CUDA stock impl)"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "sinks", "member",
     "install(): the same (CPU stock impl)"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl", "logits_soft_cap", "member",
     "install(): the cap a layer applies, handed to fold.attention(softcap=) (CUDA stock impl)"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "logits_soft_cap", "member",
     "install(): the same (CPU stock impl)"),
    (LAYER, "Attention", "get_kv_cache_spec", "method", "reads attn.sliding_window when the cache is planned"),
    (LAYER, "Attention", "_k_scale_float", "assigned", "scales(): the FP8 key scale, in forward/do_kv_cache_update"),
    (LAYER, "Attention", "_v_scale_float", "assigned", "scales(): the FP8 value scale"),
    (BACKEND, "AttentionLayer", "_k_scale_float", "field", "the layer protocol impls are handed declares it"),
    (BACKEND, "AttentionLayer", "_v_scale_float", "field", "the layer protocol impls are handed declares it"),
    # compat.check_engine_configs and models.check_engine_config / install
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", "method", "compat wraps it to check each config"),
    (f"{CONFIG}.vllm", "VllmConfig", "speculative_config", "field", "check_engine_config(), install()"),
    (f"{CONFIG}.vllm", "VllmConfig", "cache_config", "field", "check_engine_config(): .cache_dtype"),
    (f"{CONFIG}.vllm", "VllmConfig", "model_config", "field", "check_engine_config(): .max_model_len"),
    (f"{CONFIG}.cache", "CacheConfig", "cache_dtype", "field", "check_engine_config(): a dtype fold serves"),
    (f"{CONFIG}.model", "ModelConfig", "max_model_len", "field", "check_engine_config(): vs max_position_embeddings"),
    (f"{CONFIG}.model", "ModelConfig", "hf_config", "member", "the drafter's config.json (its fold block)"),
    (f"{CONFIG}.speculative", "SpeculativeConfig", "draft_model_config", "field", "the drafter's ModelConfig"),
    (f"{CONFIG}.speculative", "SpeculativeConfig", "kv_cache_dtype", "field", "check_engine_config(): the drafter's"),
    (f"{CONFIG}.speculative", "SpeculativeConfig", "num_speculative_tokens", "field",
     "install(): a sliding window must hold the draft block"),
]

# The attention class each drafter module's layers are built of (models.install serves every module with an
# ``attn`` that is an Attention and a ``rotary_emb``): drafter module -> (module, class). LiLiCorr's lattice
# attention holds no Attention, so fold leaves it to vLLM.
LAYERS = {
    f"{MODELS}.qwen3_dflash": (f"{MODELS}.qwen3_dflash", "DFlashQwen3Attention"),
    f"{MODELS}.qwen3_dflash2": (f"{MODELS}.qwen3_dflash", "DFlashQwen3Attention"),
    f"{MODELS}.qwen3_dspark": (f"{MODELS}.qwen3_dflash", "DFlashQwen3Attention"),
    f"{MODELS}.lilicorr": (f"{MODELS}.qwen3_dflash", "DFlashQwen3Attention"),
    f"{MODELS}.qwen3_xpress": (f"{MODELS}.qwen3_dflash", "DFlashQwen3Attention"),
    f"{MODELS}.ricursive_dflash2": (f"{MODELS}.qwen3_dflash", "DFlashQwen3Attention"),
    f"{MODELS}.gemma4_dspark": (f"{MODELS}.gemma4_dspark", "Gemma4DSparkAttention"),
    f"{MODELS}.laguna_dflash": (f"{MODELS}.laguna", "LagunaAttention"),
}
# What install() reads off the module, and what it falls back to where the module lacks it: attribute ->
# (the Attention(...) keyword that shows the layer has the feature, what install() does then, status).
LAYER_ATTRS = {
    "sliding_window": ("per_layer_sliding_window", "install() reads the Attention's own sliding_window", "info"),
    "attention_sink_bias": ("sinks", "install() reads the stock impl's sinks", "info"),
    "causal": (None, "install() takes the drafter config's is_causal / dflash_config.causal, and refuses the layer "
                     "naming it when the config states neither", "info"),
}
# Attention(...) arguments FoldAttentionImpl does not apply: keyword -> what install() does with such a layer
IGNORED_BY_FOLD = {"logits_soft_cap": ("info", "install() reads it off the stock impl and fold.attention applies it"),
                   "alibi_slopes": ("DIFF", "FoldAttentionImpl does not apply them")}

# Calls vLLM makes into fold's classes: (module, callee text suffix, fold Class.method, reason). Every call in
# the module whose callee (ast.unparse of the function) ends with the suffix must bind to fold's signature.
CALL_SITES = [
    (LAYER, "impl.do_kv_cache_update", "FoldAttentionImpl.do_kv_cache_update", "the KV write"),
    (LAYER, "impl.forward", "FoldAttentionImpl.forward", "the read"),
    ("vllm.v1.worker.utils", "builder_cls", "FoldMetadataBuilder.__init__", "AttentionGroup.create_metadata_builders"),
    ("vllm.v1.worker.utils", "get_metadata_builder(ubatch_idx).build", "FoldMetadataBuilder.build", "build_metadata"),
    ("vllm.v1.worker.utils", "get_metadata_builder().update_draft_decode_metadata",
     "FoldMetadataBuilder.update_draft_decode_metadata", "AttentionGroup.update_draft_decode_metadata"),
    (BACKEND, "self.build", "FoldMetadataBuilder.build", "build_for_cudagraph_capture / _drafting defaults"),
    ("vllm.v1.worker.utils", "get_metadata_builder(ubatch_idx).build_for_cudagraph_capture",
     "FoldMetadataBuilder.build_for_cudagraph_capture", "V2: AttentionGroup.build_metadata_for_cudagraph_capture"),
    ("vllm.v1.worker.gpu.attn_utils", "builder.get_cudagraph_support", "FoldMetadataBuilder.get_cudagraph_support",
     "V2: get_attn_cg_support, whether the draft step is captured in a FULL graph"),
    ("vllm.v1.worker.gpu.attn_utils", "builder.get_varlen_cudagraph_max_query_len",
     "FoldMetadataBuilder.get_varlen_cudagraph_max_query_len", "V2: which decode batches a FULL graph replays"),
    (f"{MODELS}.qwen3_dflash", "impl.do_kv_cache_update", "FoldAttentionImpl.do_kv_cache_update",
     "the DFlash context precompute's KV write (inside V2's FULL draft graph)"),
]
# Modules only a V1 model runner has: a tree without them (0.34) has no V1 runner, and "v1-" entries of
# REQUIRED are then informational
V1_RUNNER = "vllm.v1.spec_decode.dflash"

# fold methods whose signature may differ from the base's because vLLM never calls them: reason
CONSTRUCTED_BY_FOLD = {
    "FoldAttentionImpl.__init__": "models.install builds it from the stock impl's attributes; vLLM's "
                                  "Attention.__init__ builds the stock impl before fold replaces it",
}

REGISTRY = f"{MODELS}.registry"
DRAFTER_ROOTS = {(f"{MODELS}.qwen3_dflash", "DFlashQwen3ForCausalLM"), (f"{MODELS}.qwen3_dflash", "DFlashQwen3Model")}

FAILING = ("MISSING", "moved", "BREAKS", "ABSTRACT")


# ---------------------------------------------------------------------------------------------- the tree
class Tree:
    """A vLLM source tree: a wheel (zip) or a directory holding ``vllm/`` (or ``vllm/`` itself)."""

    def __init__(self, path: Path):
        self.path = path
        self._asts: dict[str, ast.Module | None] = {}
        if zipfile.is_zipfile(path):
            self._zip = zipfile.ZipFile(path)
            self.files = {n for n in self._zip.namelist() if n.endswith(".py")}
            self._root = None
        else:
            self._zip = None
            root = path.parent if (path.name == "vllm" and (path / "__init__.py").is_file()) else path
            if not (root / "vllm" / "__init__.py").is_file():
                raise SystemExit(f"{path}: neither a wheel nor a directory holding vllm/__init__.py")
            self._root = root
            self.files = set()
            for dirpath, dirnames, filenames in os.walk(root / "vllm"):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"]
                rel = Path(dirpath).relative_to(root).as_posix()
                self.files.update(f"{rel}/{f}" for f in filenames if f.endswith(".py"))

    def text(self, rel: str) -> str:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8", "replace")
        return (self._root / rel).read_text(encoding="utf-8", errors="replace")

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel in self.files:
                return rel
        return None

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.files

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._asts:
            rel = self.module_file(module)
            try:
                self._asts[module] = ast.parse(self.text(rel)) if rel else None
            except SyntaxError:
                self._asts[module] = None
        return self._asts[module]

    def version(self) -> str:
        mod = self.tree("vllm._version")
        for node in (mod.body if mod else []):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__"
                                                    for t in node.targets):
                if isinstance(node.value, ast.Constant):
                    return str(node.value.value)
        return "unknown"

    def modules_defining(self, name: str, prefix: str = "vllm") -> list[str]:
        """Modules whose top level defines ``name`` (class, def or assignment), by a text scan then AST."""
        pattern = re.compile(rf"^(class|def|async def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.M)
        found = []
        for rel in sorted(self.files):
            base = prefix.replace(".", "/")
            if not (rel.startswith(base + "/") or rel == base + ".py"):
                continue
            if not pattern.search(self.text(rel)):
                continue
            module = rel[:-3].replace("/", ".").removesuffix(".__init__")
            binding = top_bindings(self, module).get(name)
            if binding and not isinstance(binding[-1], (ast.Import, ast.ImportFrom)):
                found.append(module)
        return found


# ---------------------------------------------------------------------------------------- module scopes
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_statements(body):
    """Module-level statements, into if/try/with blocks but not ``if TYPE_CHECKING:`` bodies."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_statements(node.body)
            yield from _top_statements(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_statements(node.body)
            for handler in node.handlers:
                yield from _top_statements(handler.body)
            yield from _top_statements(node.orelse)
            yield from _top_statements(node.finalbody)
        elif isinstance(node, ast.With):
            yield from _top_statements(node.body)


_BINDINGS: dict[tuple[int, str], dict] = {}


def top_bindings(tree: Tree, module: str) -> dict[str, list[ast.AST]]:
    key = (id(tree), module)
    if key in _BINDINGS:
        return _BINDINGS[key]
    out: dict[str, list[ast.AST]] = {}
    mod = tree.tree(module)
    for node in _top_statements(mod.body if mod else []):
        names = []
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names += [t.id for t in ast.walk(target) if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        elif isinstance(node, ast.Import):
            names = [(a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(a.asname or a.name) for a in node.names if a.name != "*"]
            if any(a.name == "*" for a in node.names):
                out.setdefault("*", []).append(node)
        for name in names:
            out.setdefault(name, []).append(node)
    _BINDINGS[key] = out
    return out


def _abs_module(module: str, node: ast.ImportFrom, tree: Tree) -> str:
    if not node.level:
        return node.module or ""
    package = module if tree.is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


class Found:
    """Where a name resolved: ``kind`` in class/function/assign/module; ``module`` defining it."""

    def __init__(self, kind: str, module: str, node: ast.AST | None):
        self.kind, self.module, self.node = kind, module, node

    def where(self) -> str:
        line = f":{self.node.lineno}" if self.node is not None and hasattr(self.node, "lineno") else ""
        return f"{self.kind} in {self.module}{line}"


def resolve(tree: Tree, module: str, name: str, depth: int = 0) -> Found | None:
    """``from module import name`` in this tree, following re-exports, star imports and lazy tables."""
    if depth > 12 or tree.module_file(module) is None:
        return None
    bindings = top_bindings(tree, module)
    for node in reversed(bindings.get(name, [])):
        if isinstance(node, ast.ClassDef):
            return Found("class", module, node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found("function", module, node)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return Found("assign", module, node)
        if isinstance(node, ast.ImportFrom):
            source = _abs_module(module, node, tree)
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            if tree.module_file(f"{source}.{alias.name}"):
                return Found("module", f"{source}.{alias.name}", None)
            found = resolve(tree, source, alias.name, depth + 1)
            if found:
                return found
        if isinstance(node, ast.Import):
            alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
            target = alias.name if alias.asname else alias.name.split(".")[0]
            if tree.module_file(target):
                return Found("module", target, None)
    if tree.module_file(f"{module}.{name}"):                                # a submodule
        return Found("module", f"{module}.{name}", None)
    for node in bindings.get("*", []):
        found = resolve(tree, _abs_module(module, node, tree), name, depth + 1)
        if found:
            return found
    if "__getattr__" in bindings:                                          # MODULE_ATTRS-style lazy table
        for nodes in bindings.values():
            for node in nodes:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                    for k, v in zip(node.value.keys, node.value.values):
                        if (isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant)
                                and isinstance(v.value, str) and ":" in v.value):
                            target, _, attr = v.value.partition(":")
                            if target.startswith("."):
                                target = module + target
                            found = resolve(tree, target, attr, depth + 1)
                            if found:
                                return found
    return None


def class_of(tree: Tree, found: Found | None) -> Found | None:
    """A class, or the class of a module-level instance (``ModelRegistry = _ModelRegistry(...)``)."""
    if found is None:
        return None
    if found.kind == "class":
        return found
    if found.kind == "assign" and isinstance(getattr(found.node, "value", None), ast.Call):
        func = found.node.value.func
        if isinstance(func, ast.Name):
            return class_of(tree, resolve(tree, found.module, func.id))
    return None


def _base_found(tree: Tree, module: str, expr: ast.expr) -> Found | None:
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Name):
        return class_of(tree, resolve(tree, module, expr.id))
    if isinstance(expr, ast.Attribute):
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if isinstance(expr, ast.Name):
            head = resolve(tree, module, expr.id)
            if head and head.kind == "module" and len(parts) == 1:
                return class_of(tree, resolve(tree, head.module, parts[0]))
    return None


def mro(tree: Tree, cls: Found, seen=None) -> list[Found]:
    """The class then its bases found in the tree, depth first (enough to find members)."""
    seen = seen if seen is not None else set()
    key = (cls.module, cls.node.name)
    if key in seen:
        return []
    seen.add(key)
    out = [cls]
    for base in cls.node.bases:
        found = _base_found(tree, cls.module, base)
        if found is not None:
            out += mro(tree, found, seen)
    return out


def own_members(node: ast.ClassDef) -> dict[str, tuple[str, ast.AST]]:
    """name -> (kind, node): methods, class attributes, annotations, self.X and register_buffer("X")."""
    out: dict[str, tuple[str, ast.AST]] = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(item.name, ("method", item))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.setdefault(item.target.id, ("field", item))
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, ("attribute", item))
    for item in node.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or not item.args.args:
            continue
        self_name = item.args.args[0].arg
        for sub in ast.walk(item):
            targets = []
            if isinstance(sub, ast.Assign):
                targets = sub.targets
            elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                targets = [sub.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == self_name:
                        out.setdefault(t.attr, ("instance attribute", sub))
            if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                    and sub.func.attr in ("register_buffer", "register_parameter") and sub.args
                    and isinstance(sub.args[0], ast.Constant) and isinstance(sub.args[0].value, str)):
                out.setdefault(sub.args[0].value, ("buffer", sub))
            if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "setattr"
                    and len(sub.args) >= 2 and isinstance(sub.args[1], ast.Constant)):
                out.setdefault(str(sub.args[1].value), ("instance attribute", sub))
    return out


def find_member(tree: Tree, cls: Found, name: str) -> tuple[Found, str, ast.AST] | None:
    for klass in mro(tree, cls):
        members = own_members(klass.node)
        if name in members:
            kind, node = members[name]
            return klass, kind, node
    return None


def _decorators(fn) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        out.add(d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else "")
    return out


def is_abstract(fn) -> bool:
    return isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and "abstractmethod" in _decorators(fn)


# ----------------------------------------------------------------------------------------- signatures
def signature(fn) -> list[tuple[str, str, bool]]:
    """[(name, kind, has_default)] with kind in posonly/pos/*args/kwonly/**kwargs."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    n_defaults = len(a.defaults)
    for i, arg in enumerate(positional):
        kind = "posonly" if i < len(a.posonlyargs) else "pos"
        out.append((arg.arg, kind, i >= len(positional) - n_defaults))
    if a.vararg:
        out.append((a.vararg.arg, "*args", True))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "kwonly", default is not None))
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", True))
    return out


def bound_params(fn) -> list[tuple[str, str, bool]]:
    """The parameters a caller supplies: the first one dropped unless it is a staticmethod."""
    params = signature(fn)
    if "staticmethod" not in _decorators(fn) and params and params[0][1] in ("posonly", "pos"):
        params = params[1:]
    return params


def render(fn) -> str:
    items = []
    kwonly_started = False
    for name, kind, has_default in signature(fn):
        if kind == "kwonly" and not kwonly_started and not fn.args.vararg:
            items.append("*")
        kwonly_started = kwonly_started or kind == "kwonly"
        prefix = "*" if kind == "*args" else "**" if kind == "**kwargs" else ""
        items.append(f"{prefix}{name}{'=…' if has_default and kind in ('pos', 'posonly', 'kwonly') else ''}")
    deco = sorted(_decorators(fn) & {"staticmethod", "classmethod", "property", "abstractmethod"})
    return ("@" + ",@".join(deco) + " " if deco else "") + f"({', '.join(items)})"


def sig_diff(fold_fn, vllm_fn) -> list[str]:
    """What differs between fold's and vLLM's parameter lists (empty: the same)."""
    ours, theirs = bound_params(fold_fn), bound_params(vllm_fn)
    notes = []
    our_names = {n: (k, d) for n, k, d in ours}
    their_names = {n: (k, d) for n, k, d in theirs}
    our_pos = [n for n, k, _ in ours if k in ("posonly", "pos")]
    their_pos = [n for n, k, _ in theirs if k in ("posonly", "pos")]
    if our_pos != their_pos:
        notes.append(f"positional order fold {our_pos} vs vLLM {their_pos}")
    for name, (kind, has_default) in their_names.items():
        if name not in our_names and kind not in ("*args", "**kwargs"):
            notes.append(f"vLLM has {name}{'=default' if has_default else ' (required)'}, fold lacks it")
    for name, (kind, has_default) in our_names.items():
        if name not in their_names and kind not in ("*args", "**kwargs"):
            notes.append(f"fold has {name}{'=default' if has_default else ' (required)'} vLLM lacks")
        elif name in their_names and their_names[name][1] and not has_default:
            notes.append(f"{name}: optional in vLLM, required in fold")
    if bool(fold_fn.args.kwarg) != bool(vllm_fn.args.kwarg):
        notes.append("**kwargs on one side only")
    ours_deco = _decorators(fold_fn) & {"staticmethod", "classmethod", "property"}
    theirs_deco = _decorators(vllm_fn) & {"staticmethod", "classmethod", "property"}
    if ours_deco != theirs_deco:
        notes.append(f"decorators fold {sorted(ours_deco)} vs vLLM {sorted(theirs_deco)}")
    return notes


def bind(fn, call: ast.Call, drop_first: bool = True) -> str | None:
    """Why ``call`` cannot bind to ``fn`` (None: it binds, as far as a static look can tell)."""
    params = bound_params(fn) if drop_first else signature(fn)
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    n_pos = len(call.args)
    kwnames = [k.arg for k in call.keywords if k.arg is not None]
    has_double_star = any(k.arg is None for k in call.keywords)
    positional = [p for p in params if p[1] in ("posonly", "pos")]
    has_var = any(p[1] == "*args" for p in params)
    has_varkw = any(p[1] == "**kwargs" for p in params)
    if n_pos > len(positional) and not has_var:
        return f"{n_pos} positional arguments, fold takes {len(positional)}"
    names = {p[0]: p[1] for p in params}
    for k in kwnames:
        if k not in names and not has_varkw:
            return f"keyword {k!r} not accepted"
        if names.get(k) == "posonly":
            return f"keyword {k!r} is positional-only"
    supplied = {p[0] for p in positional[:n_pos]} | set(kwnames)
    missing = [p[0] for p in params if not p[2] and p[0] not in supplied and p[1] in ("posonly", "pos", "kwonly")]
    if missing and not has_double_star:
        return f"required {missing} not supplied"
    return None


# ------------------------------------------------------------------------------------------ fold's side
class FoldSide:
    """What fold uses, from its sources: the files importing vLLM (all of fold/vllm/), their vLLM imports,
    and per file the local names bound to vLLM objects (``compat.X`` and names imported from compat too)."""

    def __init__(self, fold_root: Path):
        self.root = fold_root
        self.files: dict[Path, ast.Module] = {}
        self.imports: list[tuple[str, str | None, Path, int, bool]] = []   # module, name, file, line, optional
        self.vllm_names: dict[Path, dict[str, tuple[str, str | None]]] = {}  # per file: local -> (module, name)
        for path in sorted(fold_root.rglob("*.py")):
            mod = ast.parse(path.read_text(encoding="utf-8"))
            if "vllm" in path.relative_to(fold_root).parts[:-1] or any(
                    (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in n.names))
                    or (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "vllm")
                    for n in ast.walk(mod)):
                self.files[path] = mod
                self._collect(path, mod)
        self.compat = self.file("compat.py")
        compat_names = self.vllm_names.get(self.compat, {})
        for path, mod in self.files.items():
            for node in ast.walk(mod):
                if isinstance(node, ast.ImportFrom) and node.module == "fold.vllm.compat":
                    for a in node.names:
                        if a.name in compat_names:
                            self.vllm_names[path][a.asname or a.name] = compat_names[a.name]
                if isinstance(node, ast.ImportFrom) and node.module == "fold.vllm" and any(
                        a.name == "compat" for a in node.names):
                    self.vllm_names[path]["compat"] = ("<compat>", None)

    def file(self, name: str) -> Path | None:
        return next((p for p in self.files if p.name == name and p.parent.name == "vllm"), None)

    def _collect(self, path: Path, mod: ast.Module) -> None:
        parents = {child: node for node in ast.walk(mod) for child in ast.iter_child_nodes(node)}
        names = self.vllm_names.setdefault(path, {})

        def optional(node) -> bool:
            while node in parents:
                node = parents[node]
                if isinstance(node, ast.Try) and any(
                        h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers):
                    return True
            return False

        for node in ast.walk(mod):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "vllm":
                        self.imports.append((a.name, None, path, node.lineno, optional(node)))
                        names[a.asname or a.name.split(".")[0]] = (a.name if a.asname else "vllm", None)
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                for a in node.names:
                    self.imports.append((node.module, a.name, path, node.lineno, optional(node)))
                    names[a.asname or a.name] = (node.module, a.name)

    def table(self, name: str):
        """``(value, line)`` of the literal ``name = ...`` in fold/vllm/compat.py, or ``(None, 0)``."""
        for node in (self.files[self.compat].body if self.compat else []):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return ast.literal_eval(node.value), node.lineno
        return None, 0

    def classes(self):
        """fold's classes whose bases are vLLM names: (file, ClassDef, [(module, name) of each vLLM base])."""
        for path, mod in self.files.items():
            names = self.vllm_names.get(path, {})
            for node in mod.body:
                if isinstance(node, ast.ClassDef):
                    bases = [names[b.id] for b in (x.value if isinstance(x, ast.Subscript) else x for x in node.bases)
                             if isinstance(b, ast.Name) and b.id in names and names[b.id][1]]
                    if bases:
                        yield path, node, bases

    def class_named(self, name: str) -> ast.ClassDef | None:
        return next((node for mod in self.files.values() for node in mod.body
                     if isinstance(node, ast.ClassDef) and node.name == name), None)


# ---------------------------------------------------------------------------------------------- checks
class Report:
    def __init__(self):
        self.lines: list[str] = []
        self.failures = 0
        self.counts: dict[str, int] = {}

    def section(self, title: str) -> None:
        self.lines += ["", f"# {title}"]

    def add(self, status: str, what: str, detail: str = "") -> None:
        self.counts[status.split()[0]] = self.counts.get(status.split()[0], 0) + 1
        self.failures += status.startswith(FAILING)
        self.lines.append(f"{status:<10} {what}" + (f"  -- {detail}" if detail else ""))


def check_name(tree: Tree, report: Report, module: str, name: str | None, at: str, optional=False) -> Found | None:
    """``import module`` / ``from module import name`` in this tree."""
    label = module + (f".{name}" if name else "")
    if tree.module_file(module) is None:
        moved = tree.modules_defining(name) if name else []
        if optional:
            report.add("missing", label, f"module file absent (optional import, {at})")
        elif moved:
            report.add("moved", label, f"module gone; {name} is defined in {', '.join(moved)} ({at})")
        else:
            report.add("MISSING", label, f"no module file {module.replace('.', '/')}.py ({at})")
        return None
    if name is None:
        report.add("ok", label, f"module {tree.module_file(module)} ({at})")
        return Found("module", module, None)
    found = resolve(tree, module, name)
    if found:
        report.add("ok", label, f"{found.where()} ({at})")
        return found
    moved = tree.modules_defining(name)
    if optional:
        report.add("missing", label, f"not bound at the module's top level (optional import, {at})"
                   + (f"; defined in {', '.join(moved)}" if moved else ""))
    elif moved:
        report.add(f"moved to {moved[0]}", label, f"not bound in {module}; defined in {', '.join(moved)} ({at})")
    else:
        report.add("MISSING", label, f"not bound at the top level of {module} nor defined elsewhere ({at})")
    return None


def find_class(tree: Tree, module: str, name: str) -> Found | None:
    """Class ``name`` as bound in ``module``, else defined in a module under it (fold duck-types these)."""
    found = class_of(tree, resolve(tree, module, name))
    for other in ([] if found else tree.modules_defining(name, prefix=module)):
        found = found or class_of(tree, resolve(tree, other, name))
    return found


def check_member(tree: Tree, report: Report, cls: Found, attr: str, kind: str, label: str, reason: str) -> None:
    hit = find_member(tree, cls, attr)
    if hit is None:
        report.add("MISSING", label, f"no member {attr!r} on {cls.node.name} or its bases in the tree ({reason})")
        return
    owner, got, node = hit
    if kind in ("field", "method") and got != kind:
        report.add("DIFF", label, f"{got}, not a {kind}, in {owner.module}.{owner.node.name}:{node.lineno} ({reason})")
        return
    extra = f" {render(node)}" if got == "method" else ""
    report.add("ok", label, f"{got}{extra} in {owner.module}.{owner.node.name}:{node.lineno} ({reason})")


def where(path: Path, root: Path, line: int) -> str:
    return f"{path.relative_to(root.parent).as_posix()}:{line}"


def flat(node: ast.AST, width: int = 110) -> str:
    return re.sub(r"\s+", " ", ast.unparse(node))[:width]


def check_gate(tree: Tree, fold: FoldSide, report: Report) -> None:
    tested, line = fold.table("TESTED")
    report.section("version gate: fold/vllm/compat.py raises ImportError unless the tree's major.minor is in TESTED")
    version = tree.version()
    if not isinstance(tested, tuple):
        report.add("MISSING", "TESTED", "no TESTED tuple in fold/vllm/compat.py")
        return
    ok = ".".join(version.split(".")[:2]) in tested
    report.add("ok" if ok else "BREAKS", f"TESTED = {tested!r}",
               f"this tree is vLLM {version} ({where(fold.compat, fold.root, line)})")


def check_imports(tree: Tree, fold: FoldSide, report: Report) -> None:
    report.section("imports: every `import vllm...` / `from vllm... import X` in fold/")
    seen = set()
    for module, name, path, line, optional in fold.imports:
        if (module, name) not in seen:
            seen.add((module, name))
            check_name(tree, report, module, name, where(path, fold.root, line), optional)


def registry_entries(tree: Tree) -> dict[str, tuple[str, str]]:
    """Every ``"Arch": ("module", "Class")`` of the registry's top-level dict literals, modules absolute."""
    out = {}
    for node in (tree.tree(REGISTRY).body if tree.tree(REGISTRY) else []):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2 and all(
                        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts):
                    module = v.elts[0].value
                    out.setdefault(k.value, (module if module.startswith("vllm.") else f"{MODELS}.{module}",
                                             v.elts[1].value))
    return out


def check_drafters(tree: Tree, fold: FoldSide, report: Report) -> dict[str, list[str]]:
    """DRAFTERS / NOT_COVERED; returns the drafter modules the tree has -> their architectures."""
    report.section("drafters: fold/vllm/compat.py DRAFTERS / NOT_COVERED against the class files and the registry")
    drafters = fold.table("DRAFTERS")[0] or {}
    not_covered = fold.table("NOT_COVERED")[0] or ()
    registry = registry_entries(tree)
    present: dict[str, list[str]] = {}
    for arch, (module, name) in drafters.items():
        if tree.module_file(module) is None:
            report.add("info", f"DRAFTERS[{arch!r}]", f"{module} is not in this version; fold registers only the "
                                                      "drafters whose module exists (compat.available_drafters)")
            continue
        present.setdefault(module, []).append(arch)
        found = check_name(tree, report, module, name, f"DRAFTERS[{arch!r}]")
        entry = registry.get(arch)
        if entry is None:
            report.add("DIFF", f"registry {arch}", "not in the registry's model tables (fold registers it itself)")
        elif entry != (module, name):
            report.add("DIFF", f"registry {arch}", f"registry maps it to {entry[0]}:{entry[1]}, fold subclasses "
                                                    f"{module}:{name}")
        else:
            report.add("ok", f"registry {arch}", f"-> {entry[0]}:{entry[1]}")
        init = find_member(tree, found, "__init__") if found and found.kind == "class" else None
        if init:
            owner, _, fn = init
            bad = [p for p, k, d in bound_params(fn) if not d and p not in ("vllm_config", "prefix")]
            report.add("BREAKS" if bad else "ok", f"{module}.{name}.__init__",
                       f"{render(fn)} in {owner.module}.{owner.node.name}; fold calls base.__init__(self, "
                       "vllm_config=..., prefix=...)" + (f"; also requires {bad}" if bad else ""))
    if not present:
        report.add("MISSING", "DRAFTERS", "no drafter module of DRAFTERS is in this tree: fold registers nothing")
    for arch in not_covered:
        entry = registry.get(arch)
        report.add("ok" if entry else "info", f"NOT_COVERED {arch}",
                   f"registry -> {entry[0]}:{entry[1]}" if entry else "not in the registry's model tables")

    report.section("registry: DFlash/DSpark drafters (a DFlashQwen3 base, or dflash/dspark in the name) "
                   "in neither DRAFTERS nor NOT_COVERED")
    for arch, (module, name) in sorted(registry.items()):
        cls = class_of(tree, resolve(tree, module, name)) if arch not in drafters and arch not in not_covered else None
        if cls is None:
            continue
        chain = {(k.module, k.node.name) for k in mro(tree, cls)}
        if chain & DRAFTER_ROOTS or re.search("dflash|dspark", f"{arch} {module} {name}", re.I):
            report.add("info", f"registry {arch}", f"-> {module}:{name} (bases "
                       + ", ".join(ast.unparse(b) for b in cls.node.bases) + ")")
    return present


def check_layers(tree: Tree, report: Report, present: dict[str, list[str]]) -> None:
    """What models.install reads off each drafter's attention modules."""
    report.section("drafter layers: what models.install reads off each drafter's attention modules (LAYERS)")
    users: dict[tuple[str, str], list[str]] = {}
    for module, archs in present.items():
        if module not in LAYERS:
            report.add("DIFF", module, f"LAYERS names no attention class for it ({', '.join(archs)}): add one")
        else:
            users.setdefault(LAYERS[module], []).extend(archs)
    for (module, name), archs in users.items():
        cls = find_class(tree, module, name)
        head = f"{module}.{name}"
        if cls is None:
            check_name(tree, report, module, name, f"the attention modules of {', '.join(archs)}")
            continue
        report.add("info", head, f"the attention modules of {', '.join(archs)}")
        hit = find_member(tree, cls, "attn")
        call = getattr(hit[2], "value", None) if hit else None
        call = call if isinstance(call, ast.Call) else None
        callee = class_of(tree, resolve(tree, hit[0].module, ast.unparse(call.func))) if call else None
        if callee is None or (LAYER, "Attention") not in {(k.module, k.node.name) for k in mro(tree, callee)}:
            report.add("MISSING", f"{head}.attn", "not assigned an Attention(...): install() serves only modules "
                                                  "whose attn is an Attention")
            call = None
        else:
            report.add("ok", f"{head}.attn", f"{flat(call, 60)}... in {hit[0].module}.{hit[0].node.name}:{call.lineno}")
        check_member(tree, report, cls, "rotary_emb", "member", f"{head}.rotary_emb",
                     "install(): rope_of(module.rotary_emb); a module without one is not served, None is refused")
        kwargs = {k.arg: k.value for k in (call.keywords if call else [])}
        for attr, (keyword, meaning, status) in LAYER_ATTRS.items():
            hit = find_member(tree, cls, attr)
            shown = kwargs.get(keyword) if keyword else None
            if hit:
                report.add("ok", f"{head}.{attr}", f"{hit[1]} in {hit[0].module}.{hit[0].node.name}:{hit[2].lineno}")
            elif keyword and (shown is None or (isinstance(shown, ast.Constant) and shown.value is None)):
                report.add("info", f"{head}.{attr}", f"absent, and its Attention(...) gets no {keyword}: fold's "
                                                     "getattr default is right")
            else:
                report.add(status, f"{head}.{attr}", "absent" + (f", though its Attention(...) gets {keyword}="
                           f"{flat(shown, 40)}" if keyword else "") + f": {meaning}")
        for keyword, (status, meaning) in IGNORED_BY_FOLD.items():
            if keyword in kwargs and not (isinstance(kwargs[keyword], ast.Constant) and kwargs[keyword].value is None):
                report.add(status, f"{head} Attention({keyword}=...)", f"gets {keyword}={flat(kwargs[keyword], 50)}: "
                           f"{meaning}")


def check_required(tree: Tree, report: Report) -> None:
    report.section("required attributes (REQUIRED at the top of this script)")
    for module, owner, attr, kind, reason in REQUIRED:
        label = f"{module}.{owner}" + (f".{attr}" if attr else "")
        if kind.startswith("v1-"):
            if tree.tree(V1_RUNNER) is None:
                report.add("info", label, f"no V1 model runner in this tree ({reason})")
                continue
            kind = kind[3:]
        cls = find_class(tree, module, owner) if kind != "name" else None
        if cls is None:
            check_name(tree, report, module, owner, reason)
        elif kind == "assigned":
            line = next((n.lineno for n in ast.walk(tree.tree(cls.module)) if isinstance(n, ast.Attribute)
                         and n.attr == attr and isinstance(n.ctx, ast.Store)), None)
            report.add("ok" if line else "MISSING", label, (f"assigned in {cls.module}:{line}" if line else
                                                            f"never assigned in {cls.module}") + f" ({reason})")
        else:
            check_member(tree, report, cls, attr, kind, label, reason)


def rotary_uses(fn: ast.FunctionDef) -> tuple[list[tuple], set[str]]:
    """``(uses, branches)`` of one function of fold/vllm/models.py: each ``rotary_emb.X`` it reads or
    calls as ``(kind, attr, node, is_call)``, ``kind`` the class name of the ``if kind == "Name":`` branch
    it stands in (None outside one), and the class names those branches name."""
    uses, branches = [], set()

    def visit(node, kind):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
                and node.test.left.id == "kind" and isinstance(node.test.comparators[0], ast.Constant)):
            branches.add(node.test.comparators[0].value)
            for child in node.body:
                visit(child, node.test.comparators[0].value)
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "rotary_emb":
            uses.append((kind, node.func.attr, node, True))
            for child in node.args + [k.value for k in node.keywords]:
                visit(child, kind)
            return
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "rotary_emb":
            uses.append((kind, node.attr, node, False))
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    for stmt in fn.body:
        visit(stmt, None)
    return uses, branches


def check_rotary_call(tree: Tree, report: Report, cls: Found, call: ast.Call, label: str, at: str,
                      reproduced: bool) -> None:
    """Whether fold's ``call`` binds to the method it names on ``cls``, each positional argument
    naming its parameter; ``reproduced``: fold reproduces this class (a branch names it, or the base),
    so a mismatch is a DIFF or BREAKS, else rope_of refuses a drafter with it (info)."""
    attr = call.func.attr
    hit = find_member(tree, cls, attr)
    if hit is None or hit[1] != "method":
        report.add("MISSING", label, f"no method {attr} on it or its bases ({at})")
        return
    owner, _, method = hit
    why = bind(method, call)
    params = [p for p, k, _ in bound_params(method) if k in ("pos", "posonly")]
    meant = [p for p, arg in zip(params, call.args) if p not in
             {n.attr for n in ast.walk(arg) if isinstance(n, ast.Attribute)}
             | {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}]
    text = f"{owner.module}.{owner.node.name}:{method.lineno} {render(method)}; fold calls {flat(call, 70)}"
    problem = why or (f"fold's argument does not name its parameter {meant}" if meant else "")
    if not problem:
        report.add("ok", label, f"{text} ({at})")
    elif reproduced:
        report.add("BREAKS" if why else "DIFF", label, f"{problem}: {text} ({at})")
    else:
        report.add("info", label, f"{problem}, so rope_of refuses a drafter with this embedding "
                                  f"({'TypeError' if why else 'its table check'}): {text} ({at})")


def check_rope(tree: Tree, fold: FoldSide, report: Report) -> None:
    """Every ``rotary_emb.X`` fold/vllm/models.py reads or calls, on the class its ``if kind == "Name":``
    branch names (``kind = type(rotary_emb).__name__``), else on the base RotaryEmbedding; a call outside a
    branch is checked on every class of the package that defines the method, except those a branch names."""
    report.section("rotary embedding: what fold/vllm/models.py reads and calls on rotary_emb, per class")
    path = fold.file("models.py")
    base = find_class(tree, f"{ROPE}.base", "RotaryEmbedding")
    if path is None or base is None:
        report.add("MISSING", f"{ROPE}.base.RotaryEmbedding" if path else "fold/vllm/models.py", "not found")
        return
    package = [(m, n) for m in sorted(f[:-3].replace("/", ".").removesuffix(".__init__") for f in tree.files
                                      if f.startswith(ROPE.replace(".", "/") + "/"))
               for n in (tree.tree(m).body if tree.tree(m) else []) if isinstance(n, ast.ClassDef)]
    inherited = {k.node for k in mro(tree, base)}
    for fn in fold.files[path].body:
        if not isinstance(fn, ast.FunctionDef) or "rotary_emb" not in [a.arg for a in fn.args.args]:
            continue
        uses, branches = rotary_uses(fn)
        seen = set()
        for kind, attr, node, is_call in uses:
            key = (kind, attr, ast.unparse(node) if is_call else None)
            if key in seen:
                continue
            seen.add(key)
            at = f"models.{fn.name}, {where(path, fold.root, node.lineno)}" + (f", {kind!r} branch" if kind else "")
            if kind:
                targets = [find_class(tree, ROPE, kind)]
                if targets[0] is None:
                    if kind not in seen:
                        seen.add(kind)
                        report.add("MISSING", f"{ROPE} class {kind}", f"no class of that name: fold matches "
                                                                      f"type(rotary_emb).__name__ ({at})")
                    continue
            elif is_call:
                targets = [base] + [Found("class", m, n) for m, n in package if n.name not in branches
                                    and own_members(n).get(attr, ("",))[0] == "method" and n not in inherited]
            else:
                targets = [base]
            for cls in targets:
                label = f"{cls.module}.{cls.node.name}.{attr}"
                if is_call:
                    check_rotary_call(tree, report, cls, node, label, at, reproduced=bool(kind) or cls is base)
                else:
                    check_member(tree, report, cls, attr, "member", label, at)


def check_attributes(tree: Tree, fold: FoldSide, report: Report) -> None:
    report.section("attribute accesses on vLLM names in fold's sources")
    seen = set()
    compat_names = fold.vllm_names.get(fold.compat, {})
    for path, mod in fold.files.items():
        names = fold.vllm_names.get(path, {})
        for node in ast.walk(mod):
            if not isinstance(node, ast.Attribute) or node.attr.startswith("__"):
                continue
            chain, head = [node.attr], node.value
            while isinstance(head, ast.Attribute):
                chain.insert(0, head.attr)
                head = head.value
            if not isinstance(head, ast.Name) or head.id not in names:
                continue
            target = names[head.id]
            if target[0] == "<compat>":                      # compat.X(.Y): X is compat's name
                if chain[0] not in compat_names or len(chain) < 2:
                    continue
                target, chain = compat_names[chain[0]], chain[1:]
            if target[1] is None or (target, chain[0]) in seen:
                continue
            seen.add((target, chain[0]))
            label = f"{target[0]}.{target[1]}.{chain[0]}"
            found = class_of(tree, resolve(tree, target[0], target[1]))
            if found is None:
                report.add("info", label, f"{target[1]} is no class ({where(path, fold.root, node.lineno)})")
            else:
                check_member(tree, report, found, chain[0], "member", label, where(path, fold.root, node.lineno))


def check_overrides(tree: Tree, fold: FoldSide, report: Report) -> None:
    report.section("overrides: fold's subclasses of vLLM classes against their vLLM bases")
    called = {target for _, _, target, _ in CALL_SITES}
    for path, node, bases in fold.classes():
        base_classes = [b for b in (class_of(tree, resolve(tree, m, n)) for m, n in bases) if b is not None]
        if not base_classes:
            report.add("MISSING", node.name, f"bases {bases} not found in the tree")
            continue
        ours = own_members(node)
        for base in base_classes:
            head = f"{node.name}({base.node.name})"
            for name, (kind, item) in ours.items():
                hit = find_member(tree, base, name)
                if kind in ("attribute", "field"):
                    if hit is None:
                        report.add("DIFF", f"{head}.{name}", "fold sets it; no vLLM base declares it (none reads it)")
                    else:
                        report.add("ok", f"{head}.{name}", f"fold sets it; declared as {hit[1]} in "
                                                           f"{hit[0].module}.{hit[0].node.name}:{hit[2].lineno}")
                    continue
                if kind != "method":
                    continue
                if hit is None or hit[1] != "method":
                    if not name.startswith("_"):
                        report.add("info", f"{head}.{name}", f"fold's own method {render(item)}, on no vLLM base"
                                   + ("; vLLM's calls to it are under call sites" if f"{node.name}.{name}" in called
                                      else ""))
                    continue
                owner, _, fn = hit
                notes = sig_diff(item, fn)
                text = f"fold {render(item)} | {owner.module}.{owner.node.name}:{fn.lineno} {render(fn)}"
                if notes and f"{node.name}.{name}" in CONSTRUCTED_BY_FOLD:
                    report.add("info", f"{head}.{name}", f"{text}: differs, and only fold calls it "
                                                         f"({CONSTRUCTED_BY_FOLD[f'{node.name}.{name}']})")
                else:
                    report.add("DIFF" if notes else "ok", f"{head}.{name}",
                               text + (f": {'; '.join(notes)}" if notes else ""))
            for klass in mro(tree, base):                              # abstract methods fold does not define
                for name, (kind, item) in own_members(klass.node).items():
                    if kind == "method" and is_abstract(item) and name not in ours and not any(
                            name in own_members(k.node) and not is_abstract(own_members(k.node)[name][1])
                            for k in mro(tree, base) if k is not klass):
                        report.add("ABSTRACT", f"{head}.{name}", f"abstract in {klass.module}.{klass.node.name}:"
                                                                 f"{item.lineno}, fold does not define it")


def check_calls(tree: Tree, fold: FoldSide, report: Report) -> None:
    report.section("call sites: vLLM's calls into fold's methods (CALL_SITES)")
    for module, suffix, target, reason in CALL_SITES:
        cls_name, _, method = target.partition(".")
        fold_cls = fold.class_named(cls_name)
        fn = own_members(fold_cls).get(method, (None, None))[1] if fold_cls is not None else None
        mod = tree.tree(module)
        if fn is None:
            report.add("info", target, "not defined by fold")
            continue
        if mod is None:
            report.add("MISSING", f"{module} calls {suffix}", f"module absent ({reason})")
            continue
        calls = [n for n in ast.walk(mod) if isinstance(n, ast.Call) and (
            ast.unparse(n.func) == suffix or ast.unparse(n.func).endswith("." + suffix))]
        if not calls:
            report.add("DIFF", f"{module} calls {suffix}", f"no such call in the module any more ({reason})")
        for call in calls:
            why = bind(fn, call)
            report.add("BREAKS" if why else "ok", f"{tree.module_file(module)}:{call.lineno} {flat(call)}",
                       f"{why + '; ' if why else ''}binds to {target}{render(fn)} ({reason})")

    report.section("call sites: fold's calls into vLLM (super() and vLLM names; rotary_emb's are above)")
    compat_names = fold.vllm_names.get(fold.compat, {})
    class_bases = {node.name: bases for _, node, bases in fold.classes()}
    for path, mod in fold.files.items():
        names = fold.vllm_names.get(path, {})
        for cls_node in [n for n in mod.body if isinstance(n, ast.ClassDef)] + [mod]:
            for call in (n for n in ast.walk(cls_node) if isinstance(n, ast.Call)):
                func, fn, label, drop = call.func, None, None, True
                if isinstance(cls_node, ast.ClassDef):                 # super().m(...) inside a class body
                    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call)
                            and ast.unparse(func.value.func) == "super"):
                        continue
                    for m, n in class_bases.get(cls_node.name, []):
                        base = class_of(tree, resolve(tree, m, n))
                        hit = find_member(tree, base, func.attr) if base else None
                        if hit and hit[1] == "method":
                            fn, label = hit[2], f"super().{func.attr} -> {hit[0].module}.{hit[0].node.name}"
                else:                                                  # a vLLM name, or compat.X: anywhere
                    chain = ast.unparse(func).split(".")
                    if chain[0] not in names:
                        continue
                    target, rest = names[chain[0]], chain[1:]
                    if target[0] == "<compat>":
                        if not rest or rest[0] not in compat_names:
                            continue
                        target, rest = compat_names[rest[0]], rest[1:]
                    found = resolve(tree, target[0], target[1]) if target[1] else None
                    if found is None:
                        continue
                    if not rest and found.kind == "function":
                        fn, label, drop = found.node, f"{found.module}.{found.node.name}", False
                    elif len(rest) == 1 and class_of(tree, found):
                        hit = find_member(tree, class_of(tree, found), rest[0])
                        if hit and hit[1] == "method":
                            fn, label = hit[2], f"{hit[0].module}.{hit[0].node.name}.{rest[0]}"
                if fn is not None:
                    why = bind(fn, call, drop_first=drop)
                    report.add("BREAKS" if why else "ok", f"{where(path, fold.root, call.lineno)} {flat(call, 90)}",
                               f"{why + '; ' if why else ''}{label}{render(fn)}")


def run(tree: Tree, fold: FoldSide) -> Report:
    report = Report()
    check_gate(tree, fold, report)
    check_imports(tree, fold, report)
    present = check_drafters(tree, fold, report)
    check_layers(tree, report, present)
    check_required(tree, report)
    check_rope(tree, fold, report)
    check_attributes(tree, fold, report)
    check_overrides(tree, fold, report)
    check_calls(tree, fold, report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a vLLM wheel (.whl) or a directory holding vllm/")
    parser.add_argument("--fold", type=Path, default=Path(__file__).resolve().parent.parent / "fold",
                        help="fold's package directory (default: this checkout's)")
    parser.add_argument("--out", type=Path, help="also write the report there, with a header")
    args = parser.parse_args(argv)
    tree = Tree(args.path)
    report = run(tree, FoldSide(args.fold.resolve()))
    summary = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items()))
    failing = sorted({line.split()[0] for line in report.lines if line.startswith(FAILING)})
    header = [f"# vLLM {tree.version()} at {args.path.name}", f"# {summary}; {'FAIL' if report.failures else 'PASS'} "
              f"({report.failures} failing" + (f": {', '.join(failing)}" if failing else "") + ")"]
    text = "\n".join(header + report.lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        digest = "n/a (a directory)"
        if args.path.is_file():
            h = hashlib.sha256()
            with open(args.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            digest = h.hexdigest()
        # the command as run from the repository root, the wheel by its file name (where it lies is the runner's)
        given = [args.path.name if a == str(args.path) else a for a in (argv or sys.argv[1:])]
        meta = [f"# command: python -m tools.check_vllm_names {' '.join(given)}",
                f"# date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}",
                f"# source: {args.path.name}", f"# sha256: {digest}"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(meta) + "\n" + text)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
