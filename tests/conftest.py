import os
import sys
from pathlib import Path

# Tests import the tiny-model helpers as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
# A checkout beside the shared data folder finds it; a fresh clone without one runs the tests that need
# no real benchmark files and skips the rest (tests/bench_data.py).
_SIBLING_DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets"
if "SPECBENCH_DATA" not in os.environ and _SIBLING_DATA.is_dir():  # set but empty: no data
    os.environ["SPECBENCH_DATA"] = str(_SIBLING_DATA)

# The compiled engine's CPU tuning (frozen weights, a C++ wrapper) makes graphs of tiny models slow to build
# and changes no path the tests check; bench/engine_speed.py and real runs use it.
os.environ.setdefault("SPECBENCH_COMPILE_TUNING", "0")

import torch  # noqa: E402

# Tiny models and per-sample tensor ops are faster single-threaded (no pool wake-ups).
torch.set_num_threads(1)

import pytest  # noqa: E402

from specbench.engine.target import embedded_gguf  # noqa: E402
from tiny import tiny_llama  # noqa: E402


def save_tiny(folder: Path, tokenizer, seed: int, context: int = 512, layers: int = 2) -> str:
    model = tiny_llama(seed, vocab=len(tokenizer), hidden=32, layers=layers, init=0.05, eos=tokenizer.eos_token_id)
    model.config.max_position_embeddings = context
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny random target and draft with SmolLM2's real tokenizer and chat template."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    root = tmp_path_factory.mktemp("models")
    return {"target": save_tiny(root / "target", tok, 0), "draft": save_tiny(root / "draft", tok, 1),
            "short": save_tiny(root / "short", tok, 0, context=64), "deep": save_tiny(root / "deep", tok, 2, layers=4)}


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped (not failed) on a machine without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
