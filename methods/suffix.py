"""Suffix decoding (Oliaro et al., "SuffixDecoding", NeurIPS 2025; Snowflake's ArcticInference,
vLLM's ``suffix`` method): draft-free speculation from suffix trees over earlier text.

Two suffix trees per query: a local one over this query's prompt and its response so far, and a
global one over the responses of the previous queries of the run (cross-request memory, FIFO
eviction past ``memory`` responses). Each step matches the longest suffix of the committed text
(up to ``depth`` tokens) in both trees and grows a speculation tree from the matched node, scoring
each continuation by its frequency (child count / parent count, multiplied down the path), keeping
nodes above ``min_prob``; the tree with the higher score (sum of those probabilities) wins. The
draft is adaptive: at most ``spec_factor * match_length + spec_offset`` tokens (the paper's
MAX_SPEC = alpha * p) and never more than ``max_spec``.

The memory follows the run's stream order, as DVI's and SpecBlock-adapt's learning does: the
drafter keeps it across queries, so it ``learns`` (no warm-up query, no --repeats; a resumed run
starts with an empty memory).

In a batch (``--batch-size``) every request drafts alone (one fork per request, see the drafter
hooks) from the one cache that all of them share, as ArcticInference runs it under vLLM: the global
tree holds the responses of the requests that have left and the partial responses of those decoding
alongside (``batch_learning``), so what a request drafts depends on its neighbours, never what it commits.

The suffix trees and the speculation are ArcticInference's own (``arctic_inference.suffix_decoding``,
C++), the implementation vLLM and the paper's authors run; it runs on a CPU without any GPU stack
(its suffix-tree extension needs only a C++ compiler and nanobind). It is an optional dependency
(extra ``suffix``): PyPI ships it as source only, and building it needs `pip install
--no-build-isolation` (its isolated build would fetch a CUDA torch). Without it this method says so
in one line before any model loads.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass

from specbench.engine.drafter import DecodeState, Drafter, VerifyResult
from specbench.errors import SpecbenchError
from specbench.options import option
from specbench.engine.tree import DraftTree

METHOD = "suffix"
INSTALL = ("pip install nanobind==2.9.2 grpcio-tools protobuf cmake ninja && "
           "pip install --no-build-isolation --no-deps arctic-inference")


def arctic_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


@dataclass
class SuffixOptions:
    # Defaults: ArcticInference's (suffix_cache_max_depth 64, max_spec_factor 1.0, offset 0,
    # min_token_prob 0.1, 100000 cached requests; 16 speculative tokens when none are set).
    max_spec: int = option(16, "Most tokens one step drafts (tree nodes).", ge=1, tokens=True)
    depth: int = option(64, "Depth of the suffix trees: the longest context suffix matched and the longest draft.",
                        ge=1)
    spec_factor: float = option(1.0, "alpha: a match of p tokens drafts at most alpha*p + spec_offset tokens.",
                                ge=0)
    spec_offset: float = option(0.0, "Tokens added to alpha*p (see spec_factor).", ge=0)
    min_prob: float = option(0.1, "Drop draft tokens whose estimated probability is below this.", ge=0, le=1)
    memory: int = option(100000, "Previous responses kept in the global suffix tree (FIFO).", ge=1,
                         note="the global tree over earlier responses is what suffix decoding adds to prompt lookup")
    tree: bool = option(True, "Draft a tree (the paper); false: one chain, as vLLM's suffix method.")

    def check(self, owner: str) -> None:
        if not arctic_available():
            raise SpecbenchError(f"{owner} needs the arctic-inference package (its suffix trees): {INSTALL}")


class SuffixDrafter(Drafter):
    name = METHOD
    label = "Suffix decoding"
    Options = SuffixOptions
    budget_option = "max_spec"
    learns = True  # the global tree grows with every response of the stream
    batch_learning = True  # concurrent requests share that tree by design (ArcticInference serves them so)

    def setup(self, target) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        super().setup(target)
        self.cache = SuffixDecodingCache(max_tree_depth=self.options.depth,
                                         max_cached_requests=self.options.memory)
        self.responses: dict[int, list[int]] = {}  # what the global tree holds, to rebuild it (see __deepcopy__)
        self.next_request = [0]  # a batch's forks share it (and the cache): each request gets its own id

    def begin(self, state: DecodeState, prefill) -> None:
        self.request = self.next_request[0]
        self.next_request[0] += 1
        self.cache.start_request(self.request, state.tokens[: state.prompt_len])
        self.responses[self.request] = []
        self._respond(state.tokens[state.prompt_len:])  # the prefill's token
        self.turn = {"drafted": 0, "steps_with_draft": 0, "match_len": 0}

    def propose(self, state: DecodeState) -> DraftTree:
        o = self.options
        with state.timer.phase("tree_build"):
            draft = self.cache.speculate(self.request, state.tokens[-o.depth:], max_spec_tokens=o.max_spec,
                                         max_spec_factor=o.spec_factor, max_spec_offset=o.spec_offset,
                                         min_token_prob=o.min_prob, use_tree_spec=o.tree)
        if not draft.token_ids:
            return DraftTree.empty()
        self.turn["drafted"] += len(draft.token_ids)
        self.turn["steps_with_draft"] += 1
        self.turn["match_len"] += draft.match_len
        return DraftTree(draft.token_ids, draft.parents)

    def observe(self, state: DecodeState, result: VerifyResult) -> None:
        self._respond(result.committed)

    def _respond(self, tokens) -> None:
        self.cache.add_active_response(self.request, tokens)
        self.responses[self.request].extend(tokens)

    def end(self, state: DecodeState) -> dict:
        self.cache.stop_request(self.request)  # its response stays in the global tree
        for evicted in self.responses.keys() - self.cache.cached_requests:
            del self.responses[evicted]
        steps = max(self.turn["steps_with_draft"], 1)
        return {"suffix_drafted": self.turn["drafted"], "suffix_steps_with_draft": self.turn["steps_with_draft"],
                "suffix_mean_match_len": round(self.turn["match_len"] / steps, 3),
                "suffix_memory": len(self.cache.cached_requests)}

    def __deepcopy__(self, memo: dict) -> "SuffixDrafter":
        """A copy with its own global tree holding the same responses in the same order (the forced check's
        pass runs on a copy: ``Drafter.learns``). ArcticInference's C++ tree cannot be copied, so it is
        rebuilt from the responses; called between turns, when no request is active."""
        if self.cache.active_requests:
            raise RuntimeError("a suffix drafter is copied between turns, not during one")
        twin = copy.copy(self)
        memo[id(self)] = twin
        for key, value in vars(self).items():
            if key != "cache":
                setattr(twin, key, copy.deepcopy(value, memo))
        twin.cache = type(self.cache)(max_tree_depth=self.cache.max_tree_depth,
                                      max_cached_requests=self.cache.max_cached_requests)
        for request in self.cache.cached_requests:  # insertion order: oldest first, as FIFO eviction needs
            twin.cache.start_request(request, [])
            twin.cache.add_active_response(request, self.responses[request])
            twin.cache.stop_request(request)
        return twin
