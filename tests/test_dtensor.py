"""PyTorch's own parallel stack on real gloo ranks: FSDP2 (``fully_shard``) on 2 and 4 ranks with its
policies, tensor parallelism (``parallelize_module``) and FSDP2 over TP on a 2x2 mesh, each against the
statistics of the whole tensors (``DTensor.full_tensor()`` in the same run) and against a single process that
trains the same model on the same batches (tests/dtensor_worker.py). The jobs of one world size run in one
launch (one start-up of the ranks for several trainings)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from launch import free_port, run_ranks

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dtensor_worker.py")
PARAM_KINDS = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
RTOL = 1e-5


def train(out: Path, world: int, *jobs: str) -> dict[str, list[list[dict]]]:
    """Run ``jobs`` in turn on ``world`` ranks; returns each job's ranks' steps."""
    run_ranks([sys.executable, str(WORKER), str(out), str(world), str(free_port()), *jobs], world)
    folder = {job: job.replace(":", "_").replace(",", "_").replace("/", "_") for job in jobs}
    return {
        job: [json.loads((out / folder[job] / f"rank_{rank}.json").read_text()) for rank in range(world)]
        for job in jobs
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    """The single process on the whole global batch, and on each half of it (what each of two
    data-parallel ranks sees)."""
    runs = train(tmp_path_factory.mktemp("reference"), 1, "single", "single:part0of2", "single:part1of2")
    return {
        "whole": runs["single"][0],
        "part0": runs["single:part0of2"][0],
        "part1": runs["single:part1of2"][0],
    }


def close(a: float, b: float, rtol: float = RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


def assert_whole_tensors(ranks: list[list[dict]]) -> int:
    """Every rank's statistics of every parameter-side tensor, every step, are those of the whole tensor."""
    checked = 0
    for rank, steps in enumerate(ranks):
        for step, record in enumerate(steps):
            assert record["truth"], "the loop recorded nothing"
            for key, truth in record["truth"].items():
                got = record["monitor"].get(key)
                assert got is not None, f"rank {rank} step {step}: {key} not collected"
                for stat in ("min", "max", "norm"):
                    assert close(got[stat], truth[stat]), (rank, step, key, stat, got[stat], truth[stat])
                    checked += 1
    return checked


def assert_like_reference(
    steps: list[dict], reference: list[dict], kinds: tuple[str, ...], only: str = ""
) -> int:
    """Step 0's statistics of ``kinds`` equal the single process's (the same weights, the same batch). The
    minimum of exp_avg_sq is a square of the smallest gradient element, whose relative rounding is large
    (the sum of the batch's terms nearly cancels): its norm and maximum are compared."""
    mine, theirs = steps[0]["monitor"], reference[0]["monitor"]
    keys = [key for key in theirs if key.split("/")[0] in kinds and re.search(only, key)]
    assert keys, f"the reference has no {kinds}"
    for key in keys:
        assert key in mine, f"{key} not collected"
        stats = ("max", "norm") if key.startswith("exp_avg_sq/") else ("min", "max", "norm")
        for stat in stats:
            assert close(mine[key][stat], theirs[key][stat]), (key, stat, mine[key][stat], theirs[key][stat])
    return len(keys)


def losses(ranks: list[list[dict]]) -> list[list[float]]:
    return [[step["loss"] for step in steps] for steps in ranks]


def test_fsdp2_and_tensor_parallelism_on_two_ranks(tmp_path, references):
    jobs = ("fsdp", "fsdp:off", "fsdp:bf16,keep", "fsdp:offload", "tp", "tp:off", "tp:rank0")
    runs = train(tmp_path, 2, *jobs)
    # FSDP2: every rank holds the merged statistics of the whole tensors
    ranks = runs["fsdp"]
    assert assert_whole_tensors(ranks) > 5 * 20 * 3 * 2
    for steps in ranks:
        assert assert_like_reference(steps, references["whole"], PARAM_KINDS + ("update", "ratio")) >= 5 * 20
    # before the reduce-scatter: rank r's gradient and activations are those of its half of the batch
    for rank, steps in enumerate(ranks):
        part = references[f"part{rank}"]
        assert assert_like_reference(steps, part, ("grad_unreduced", "actv", "actv_grad")) > 60
    assert losses(runs["fsdp:off"]) == losses(ranks)
    # bf16 parameters with fp32 reduction and no resharding after forward; CPU offload
    assert_whole_tensors(runs["fsdp:bf16,keep"])
    assert_whole_tensors(runs["fsdp:offload"])
    # tensor parallelism: activations too are the whole logical tensors, as in the single process
    ranks = runs["tp"]
    assert_whole_tensors(ranks)
    kinds = PARAM_KINDS + ("grad_unreduced", "actv", "actv_grad")
    for steps in ranks:
        assert assert_like_reference(steps, references["whole"], kinds) > 5 * 20 + 60
    assert losses(runs["tp:off"]) == losses(ranks)
    # module_ranks cannot leave a rank out of the merges of the activations' pieces: both ranks collect
    assert_whole_tensors(runs["tp:rank0"])
    assert (
        runs["tp:rank0"][1][0]["monitor"]["actv/blocks.0.fc1.output"]
        == ranks[1][0]["monitor"]["actv/blocks.0.fc1.output"]
    )


def test_fsdp2_on_four_ranks_and_over_tensor_parallelism_on_a_2x2_mesh(tmp_path, references):
    runs = train(tmp_path, 4, "fsdp", "2d", "2d:off")
    assert_whole_tensors(runs["fsdp"])
    assert_like_reference(runs["fsdp"][3], references["whole"], PARAM_KINDS)
    ranks = runs["2d"]
    assert_whole_tensors(ranks)
    mesh = [[0, 1], [2, 3]]  # (dp, tp): ranks 0 and 1 train on the first half of each global batch
    for dp, tp_ranks in enumerate(mesh):
        for rank in tp_ranks:
            assert_like_reference(ranks[rank], references["whole"], PARAM_KINDS)
            kinds = ("grad_unreduced", "actv", "actv_grad")
            assert_like_reference(ranks[rank], references[f"part{dp}"], kinds)
    assert losses(runs["2d:off"]) == losses(ranks)


# the torchtitan-style Llama's modules that tensor parallelism parallelises (their inputs and outputs are
# DTensors, or pieces it hands on): with sequence parallelism the modules around them receive plain pieces
TITAN_PARALLEL = r"(tok_embeddings|_norm|\.norm|\.w[qkvo123]|output)\.(input|output)"


def test_a_torchtitan_style_llama_on_a_2x2_mesh(tmp_path, tmp_path_factory):
    """torchtitan's plan on the Llama of tests/titan_llama.py: tensor parallelism of the attention and SwiGLU
    projections, with and without sequence parallelism, inside FSDP2 on a (dp, tp) = (2, 2) mesh, against a
    single process (compiled blocks, mixed precision and accumulation: tests/test_titan.py)."""
    reference = train(
        tmp_path_factory.mktemp("titan"), 1, *(f"titan/single{p}" for p in ("", ":part0of2", ":part1of2"))
    )
    whole, parts = reference["titan/single"][0], [reference[f"titan/single:part{r}of2"][0] for r in (0, 1)]
    jobs = ("titan/2d", "titan/2d:sp", "titan/2d:off", "titan/2d:off,sp", "titan/2d:fwd")
    runs = train(tmp_path, 4, *jobs)
    # bitwise with every kind, activation gradients included (their node hooks leave autograd's sums as
    # they are: docs/output.md)
    assert losses(runs["titan/2d:off"]) == losses(runs["titan/2d:fwd"])
    for job in ("titan/2d", "titan/2d:sp"):
        assert losses(runs[job]) == losses(runs["titan/2d:off,sp" if job.endswith("sp") else "titan/2d:off"])
    for job in ("titan/2d", "titan/2d:sp"):
        ranks = runs[job]
        assert_whole_tensors(ranks)
        for rank, steps in enumerate(ranks):
            assert_like_reference(steps, whole, PARAM_KINDS)
            only = TITAN_PARALLEL if job.endswith(":sp") else ""
            assert assert_like_reference(steps, parts[rank // 2], ("actv",), only) > 20
            assert_like_reference(steps, parts[rank // 2], ("grad_unreduced",))
