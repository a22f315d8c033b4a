"""The host reads a decode step makes, counted on CPU and held to a stated budget.

The decoder is meant for GPUs. There every read of a tensor's value on the host (``.item()``,
``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__()``, ``.cpu()``, ``.numpy()``,
and ``.nonzero()``, whose size is data) waits until the device has run all the work queued before it;
on a CPU it costs nothing, so nothing else would show one creeping into the loop. This test counts
the reads headway's own code makes in every step (a target forward's, transformers', are not
counted), for each drafting path, greedy and sampled, a batch of one and of three, and holds each
step to the budget below. The decoder verifies with every node's logits here (``verify_logits="all"``,
what it does off the CPU): on-demand lm_head rows are a CPU-only path that reads per accepted node.
"""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import headway
from headway.decode import speculator as speculator_module
from headway.decode import step as step_module
from headway.decode import Speculator
from headway.testing import tiny_target

from test_decode_exact import make_heads

# -- the budget: host reads per drafted step, each needed by the Python side -------------------------
GREEDY = 2  # verify_greedy: how many nodes each row accepted, all rows in one read (the KV entries kept and
#             the tokens emitted depend on it); commit: the accepted nodes and the emitted tokens of all rows
#             in one read (the output is a Python list checked for EOS, and whether the KV entries move)
ADAPTIVE = 1  # an adaptive tree: how many candidates pay for their verify cost (the forward's token count)
SAMPLED_CHAIN_PER_ROW = 1  # verify_sampled_chain: how many of the row's drafts passed (one vectorised test)
SAMPLED_CHAIN = 1  # commit's one read, as greedy
PLAIN = 1  # a step without drafts: the rows' next tokens
ROWS_LEAVE_PER_CACHE = 2  # a step where a row finishes: which slot columns the other rows still use
#                           (used_columns: are all used, then which), per padded cache: the target's, and
#                           EAGLE's and DFlash's own
TIMING_SYNCS = 3  # hardware.sync around the verify forward and at the end (GPU only): the step's times


def fork_budget(depth: int, rows: int) -> int:
    """A sampled ``fork-N`` tree, walked by recursive rejection: per row, its tree on the host (1), one
    test per child tried (at most the 2N drafts) and, while drafting, per drawn sibling whether the
    first draw left the drafter's distribution any mass (N); then commit's one read."""
    return rows * (1 + 2 * depth + depth) + 1


READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")
HEADWAY = str(Path(headway.__file__).parent)
TORCH = str(Path(torch.__file__).parent)


class HostReads:
    """Counts the reads made by headway's code (the first caller outside torch's own Python), and
    the reads, the rows and the timing syncs of every decode step."""

    def __init__(self, monkeypatch):
        self.where, self.steps, self.syncs = Counter(), [], 0
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))
        real_step, real_sync = speculator_module.step, step_module.sync

        def step(rt, policy, batch, *args, **kwargs):
            before, syncs, rows = sum(self.where.values()), self.syncs, len(batch.rows)
            out = real_step(rt, policy, batch, *args, **kwargs)
            self.steps.append((rows, sum(self.where.values()) - before, self.syncs - syncs, len(out[2])))
            return out

        def sync(device):
            self.syncs += 1
            real_sync(device)

        monkeypatch.setattr(speculator_module, "step", step)
        monkeypatch.setattr(step_module, "sync", sync)

    def _counting(self, method, name):
        def read(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(HEADWAY):
                self.where[f"{frame.f_code.co_filename[len(HEADWAY) + 1:]}:{frame.f_lineno} {name}"] += 1
            return method(tensor, *args, **kwargs)
        return read


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
GREEDY_CASES = [("medusa", "mc_sim_7b_63"), ("eagle1", "chain-4"), ("eagle3", "dynamic-4-4-12"), ("dflash", "chain-4"),
                ("dflash-correction", "dynamic-3-3-8")]


def run(llama, monkeypatch, kind, tree, rows, temperature=0.0, **kw):
    """One generation of ``rows`` prompts, counted (after one uncounted run: the kernels' plan and
    the lm_head probe are measured once)."""
    model, tok = llama
    spec = Speculator(model, tok, make_heads(kind, model), tree=tree, sampling_tree=tree, verify_logits="all",
                      linear_kernel="stock", **{"batch_policy": "always", **kw})
    spec.generate_batch(PROMPTS[:rows], max_new_tokens=16, temperature=temperature, seed=0)
    reads = HostReads(monkeypatch)
    spec.generate_batch(PROMPTS[:rows], max_new_tokens=[16, 12, 20][:rows], temperature=temperature, seed=0)
    assert len(reads.steps) >= 3
    return reads


def within(reads, budget, caches=1):
    """Every step within ``budget`` (plus the columns check where rows left), with its timing syncs."""
    for rows, n, syncs, left in reads.steps:
        allowed = budget(rows) + (ROWS_LEAVE_PER_CACHE * caches if left and left < rows else 0)
        assert n <= allowed, f"{n} host reads in a step of {rows} rows (budget {allowed}): {dict(reads.where)}"
        assert syncs <= TIMING_SYNCS


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind,tree", GREEDY_CASES)
def test_a_greedy_step_reads_twice_whatever_the_rows(llama, monkeypatch, kind, tree, rows):
    reads = run(llama, monkeypatch, kind, tree, rows)
    within(reads, lambda b: GREEDY, caches=1 if kind == "medusa" else 2)
    assert min(n for _, n, _, _ in reads.steps) == GREEDY  # no read per row: one tensor pass for all rows


def test_an_adaptive_step_reads_its_size(llama, monkeypatch):
    within(run(llama, monkeypatch, "eagle1", "adaptive-4-4-12", 1), lambda b: GREEDY + ADAPTIVE)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_sampled_chain_reads_once_per_row(llama, monkeypatch, kind, rows):
    reads = run(llama, monkeypatch, kind, "chain-3", rows, temperature=1.0)
    within(reads, lambda b: b * SAMPLED_CHAIN_PER_ROW + SAMPLED_CHAIN, caches=2)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_sampled_fork_reads_what_its_walk_tries(llama, monkeypatch, rows):
    within(run(llama, monkeypatch, "eagle1", "fork-2", rows, temperature=1.0), lambda b: fork_budget(2, b), caches=2)


def test_a_plain_step_reads_the_next_tokens(llama, monkeypatch):
    reads = run(llama, monkeypatch, "eagle1", "chain-4", 3, batch_policy="auto", by_batch={3: False, 2: False, 1: False})
    within(reads, lambda b: PLAIN, caches=2)


def test_the_count_can_fail(llama, monkeypatch):
    """Accepting row by row (one read per row per step, as ``accept`` once did) is caught."""
    def row_by_row(policy, batch, scored):
        return [step_module.verify_row(scored.drafts.trees[b], scored.node_logits[b], r.params, r.gen)
                for b, r in enumerate(batch.rows)]

    monkeypatch.setattr(step_module, "accept", row_by_row)
    reads = run(llama, monkeypatch, "eagle1", "chain-4", 3)
    with pytest.raises(AssertionError, match="host reads in a step of 3 rows"):
        within(reads, lambda b: GREEDY, caches=2)
