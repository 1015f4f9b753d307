"""The colocated loop's CPU side: the demo refuses a host without a GPU, and the checks' pure parts."""

from __future__ import annotations

import pytest
import torch

from miles_fsm.apps.cli import main
from miles_fsm.apps.colocated.checks import compare, engine_layout, input_logprobs, verdict, wrong_caught
from miles_fsm.apps.colocated.config import FULL, SMOKE, LoopConfig, Tolerance
from miles_fsm.apps.colocated.report import parse_args
from miles_fsm.drivers.errors import EngineRequestError


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_demo_megatron_sglang_is_refused_without_a_gpu_in_one_line(capsys, tmp_path):
    """``miles-fsm demo --stack megatron-sglang`` on a host without CUDA exits 2 with one line saying what
    the host lacks, before anything starts or is written."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--stack", "megatron-sglang", "--trace-dir", str(tmp_path / "t")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "--stack megatron-sglang runs on a CUDA host" in err and "lacks a CUDA GPU" in err, err
    assert not (tmp_path / "t").exists()


def _answer(ids, lps):
    return {"meta_info": {"input_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)]}}


def test_input_logprobs_reads_tokens_one_onward_and_refuses_other_shapes():
    """SGLang's batched answer gives, per prompt, the logprobs of tokens 1..n-1 (the first is null); an answer
    with another count, other ids or a non-null first logprob is an EngineRequestError saying so."""
    ids = [[5, 6, 7], [8, 9, 10]]
    body = [_answer(ids[0], [None, -1.0, -2.0]), _answer(ids[1], [None, -3.0, -4.0])]
    assert input_logprobs("e", body, ids) == [[-1.0, -2.0], [-3.0, -4.0]]
    bad = {
        "2 answers for 3 prompts": (body, ids + [[1, 2]]),
        "2 input logprobs for 3 input tokens": ([_answer([5, 6], [None, -1.0]), body[1]], ids),
        "not the ids sent": ([_answer([5, 6, 99], [None, -1.0, -2.0]), body[1]], ids),
        "not null": ([_answer(ids[0], [-0.5, -1.0, -2.0]), body[1]], ids),
        "is not \\[logprob, token id": ([{"meta_info": {"input_token_logprobs": [None, [-1.0, 6], [-2.0, 7]]}},
                                          body[1]], ids),
        "not a number": ([_answer(ids[0], [None, "-1.0", -2.0]), body[1]], ids),
    }
    for says, (answer, sent) in bad.items():
        with pytest.raises(EngineRequestError, match=says):
            input_logprobs("e", answer, sent)


def test_input_logprobs_matches_answers_to_prompts_by_their_ids():
    """A batched answer in another order than the prompts (seen on SGLang 0.5.17) is put back in prompt order by
    the token ids each answer echoes; an answer that repeats a prompt is refused."""
    ids = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    lps = [[None, -1.0, -2.0], [None, -3.0, -4.0], [None, -5.0, -6.0]]
    body = [_answer(ids[2], lps[2]), _answer(ids[0], lps[0]), _answer(ids[1], lps[1])]
    assert input_logprobs("e", body, ids) == [[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]
    with pytest.raises(EngineRequestError, match="repeats prompt 0"):
        input_logprobs("e", [_answer(ids[0], lps[0]), _answer(ids[0], lps[0]), body[2]], ids)


def test_compare_and_the_verdicts():
    """max/mean |delta| over every token; within tolerance passes; a wrong conversion is caught only when it
    fails the tolerance AND is ``margin`` times the right one's error."""
    stats = compare([[0.0, -1.0], [-2.0]], [[0.01, -1.03], [-2.0]])
    assert stats["tokens"] == 3 and stats["max_abs"] == pytest.approx(0.03)
    assert stats["mean_abs"] == pytest.approx(0.04 / 3)
    tol = Tolerance(mean=0.05, max=0.5, margin=5.0)
    assert verdict(stats, tol)
    assert not verdict({"mean_abs": 0.01, "max_abs": 0.6}, tol)
    right = {"mean_abs": 0.02, "max_abs": 0.1}
    assert wrong_caught({"mean_abs": 0.3, "max_abs": 2.0}, right, tol)
    assert not wrong_caught({"mean_abs": 0.06, "max_abs": 0.2}, right, tol)  # fails, but not by the margin
    assert not wrong_caught({"mean_abs": 0.04, "max_abs": 0.2}, {"mean_abs": 0.001, "max_abs": 0.01}, tol)


def test_engine_layout_fuses_qkv_and_gate_up_in_sglangs_order():
    """q, k, v and gate, up become SGLang's qkv_proj / gate_up_proj (concatenated on dim 0, in that order);
    a fused weight with a part missing is left out, since the engine keeps its old part."""
    t = {n: torch.full((2, 3), float(i)) for i, n in enumerate(
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj"])}  # fmt: skip
    p = "model.layers.0."
    named = [(p + "self_attn." + n + ".weight", t[n]) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    named += [(p + "mlp." + n + ".weight", t[n]) for n in ("gate_proj", "up_proj")]
    named += [("model.layers.1.self_attn.q_proj.weight", t["q_proj"]), ("lm_head.weight", t["o_proj"])]
    out = engine_layout(named)
    assert sorted(out) == sorted([p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight",
                                  p + "mlp.gate_up_proj.weight", "lm_head.weight"])  # fmt: skip
    assert out[p + "self_attn.qkv_proj.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert out[p + "mlp.gate_up_proj.weight"][:, 0].tolist() == [3, 3, 4, 4]


def test_the_run_configs():
    """The full run is a >= 1 B Llama shape over both strategies; --smoke is small, 1 cycle, one strategy;
    the server's config.json names bf16 (SGLang would otherwise pick fp16 for a dtype-less config)."""
    full, problems = parse_args(["--out", "x.json"])
    assert full.shape is FULL and full.cycles == 3 and [s.value for s in full.strategies] == ["rematerialize", "backup"]
    smoke, _ = parse_args(["--out", "x.json", "--smoke"])
    assert smoke.shape is SMOKE and smoke.cycles == 1 and [s.value for s in smoke.strategies] == ["rematerialize"]
    s = FULL
    params = s.vocab * s.hidden * 2 + s.layers * (s.hidden * (s.heads + 2 * s.query_groups) * s.head_dim
                                                  + s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.ffn_hidden)
    assert params >= 1e9
    cfg = full.server_config
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_key_value_heads"] == 4 and not cfg["tie_word_embeddings"]
    assert LoopConfig(cycles=0, seq=1).problems()[:2] == ["cycles must be >= 1, got 0",
                                                          "need >= 1 prompt of >= 2 tokens, got 8 x 1"]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in problems


def test_stopping_a_server_ends_its_whole_process_group(tmp_path):
    """A server's scheduler may ignore TERM and outlive the launcher: ``stop_process_group`` still leaves
    nothing running (the colocated loop and ``gpu_sglang.py`` stop their servers through it)."""
    import os
    import subprocess
    import time

    from miles_fsm.apps.colocated.server import stop_process_group

    pid_file = tmp_path / "child.pid"
    # The child ignores TERM, as a busy scheduler may; the leader dies on TERM.
    script = f"(trap '' TERM; echo $BASHPID > {pid_file}; sleep 60) & wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    stop_process_group(proc)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        raise AssertionError("the TERM-ignoring child outlived stop_process_group")
    stop_process_group(proc)  # idempotent: the group is gone


def test_the_push_phases_are_made_disjoint_before_their_shares_are_taken():
    """The push's timers nest (the request serializes, serializing a flattened bucket flattens first); the
    report takes each phase's own time, so the shares of a push add up to at most the push and a slow flatten
    is named once, as the flatten (an H200 cycle had 0.44 s of flatten counted three times)."""
    from miles_fsm.apps.colocated.report import exclusive_phases, speed_summary

    nested = {"update_weights_from_tensor request": 0.488, "serialize (pickle + base64)": 0.446,
              "flatten bucket (copy)": 0.441, "convert": 0.010, "weights_checker (engine hashes)": 0.028}  # fmt: skip
    own = exclusive_phases(nested)
    assert own == pytest.approx({"engine load (request minus serialize)": 0.042, "serialize (pickle + base64)": 0.005,
                                 "flatten bucket (copy)": 0.441, "convert": 0.010,
                                 "weights_checker (engine hashes)": 0.028})  # fmt: skip
    assert exclusive_phases({"update_weights_from_tensor request": 0.07, "serialize (pickle + base64)": 0.01}) == \
        pytest.approx({"engine load (request minus serialize)": 0.06, "serialize (pickle + base64)": 0.01})  # fmt: skip

    cycle = {"profile": None, "guard_and_trace_s": 0.001, "lifecycle_s": 1.0,
             "push": {"s": 0.56, "bytes": 2_200_000_000, "phases_s": nested}}  # fmt: skip
    result = {"runs": [{"strategy": "backup", "load_format": "flattened_bucket", "cycles": [cycle]}],
              "limits": {"device_copy_GBps": 2000.0}}  # fmt: skip
    run = speed_summary(result)["runs"][0]
    assert sum(run["push_phase_shares"].values()) <= 1.0
    assert run["bottleneck"] == "flatten bucket (copy)"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--ranks", "4"], "--ranks run(s) with --stack cpu only"),
        (["--inject", "crash:0:1", "--no-audit"], "--inject, --no-audit run(s) with --stack cpu only"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
    ],
)
def test_demo_megatron_sglang_refuses_what_does_not_apply_before_anything_starts(capsys, tmp_path, extra, says):
    """The colocated loop has one GPU rank, the megatron trainer and a real engine: the CPU stack's options
    are refused rather than ignored, and --steps 0 is refused rather than run as the default 3 cycles; on
    any host, before the host's requirements are looked at or anything is written."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--stack", "megatron-sglang", "--trace-dir", str(tmp_path / "t"), *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "t").exists()


def test_the_loops_cycles_default_only_when_not_given():
    """``--cycles 0`` is a config problem, not the default."""
    cfg, problems = parse_args(["--out", "x.json", "--cycles", "0"])
    assert cfg.cycles == 0 and "cycles must be >= 1, got 0" in problems
    assert parse_args(["--out", "x.json"])[0].cycles == 3 and parse_args(["--out", "x", "--smoke"])[0].cycles == 1
