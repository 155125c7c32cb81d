"""The evaluation book: pieces out to generators at the right version, reports in, scores exact."""

import json
from pathlib import Path

from conftest import ROOT, FakeClock

from asyncrl.config import EvalConfig, load_config
from asyncrl.control.evaluation import EvalBook, score
from asyncrl.wire.protocol import EvalReport, EvalTrace


def eval_args(weights: Path, tmp_path: Path) -> list[str]:
    """``asyncrl eval`` arguments that score ``weights`` on the tiny config, two new tokens a prompt.

    The dataset is ten digit prompts, five of them held out, written under ``tmp_path``.
    """
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{n}=", "answer": f"{n}"}) + "\n" for n in range(10))
    )
    return [
        str(ROOT / "configs/ci-tiny.yaml"),
        "--weights",
        str(weights),
        "--generator.backend=transformers",
        f"--task.dataset={tmp_path / 'rows.jsonl'}",
        "--task.eval_fraction=0.5",
        "--eval.k=2",
        "--task.reward=asyncrl.tasks.digits:digit_reward",
        "--generator.max_new_tokens=2",
    ]


def trace(index, reward, greedy, version=3):
    return EvalTrace(index=index, prompt="p", response="r", answer=None, reward=reward, version=version, greedy=greedy)


def test_pass_at_1_is_the_greedy_answer_and_pass_at_k_any_sample():
    traces = [
        trace(0, 1.0, True),
        trace(0, 0.0, False),
        trace(0, 0.0, False),
        trace(1, 0.0, True),
        trace(1, 1.0, False),
        trace(1, 0.0, False),
        trace(2, 0.0, True),
        trace(2, 0.0, False),
        trace(2, 0.0, False),
    ]
    assert score(traces, k=2, threshold=1.0) == (1 / 3, 1 / 3, 3)
    assert score(traces, k=2, threshold=0.0) == (1.0, 1.0, 3)


def test_pieces_go_to_generators_holding_the_version_and_the_first_report_counts():
    book = EvalBook(
        EvalConfig(every_steps=10, k=2, items_per_request=2, max_items=5),
        num_items=9,
        max_new_tokens=8,
        threshold=1.0,
        reissue_after_s=60,
    )
    assert book.due(20) and not book.due(25)
    book.schedule(version=3, step=20)
    assert book.next_piece(generator_version=2) is None  # older weights cannot evaluate v3
    pieces = [book.next_piece(3) for _ in range(4)]
    assert [p.indices for p in pieces[:3]] == [[0, 1], [2, 3], [4]] and pieces[3] is None  # nothing twice at once
    for p in pieces[:3]:
        traces = [t for i in p.indices for t in (trace(i, 1.0, True), trace(i, float(i % 2), False))]
        book.report(EvalReport(generator_id="g", version=3, indices=p.indices, traces=traces))
        book.report(EvalReport(generator_id="late", version=3, indices=p.indices, traces=[]))  # ignored
    (result,) = book.finished()
    assert (result.version, result.step, result.num_prompts) == (3, 20, 5)
    assert (result.pass_at_1, result.pass_at_k) == (1.0, 2 / 5)
    assert book.pending() == 0 and book.finished() == []


def test_a_piece_never_reported_is_handed_out_again():
    clock = FakeClock()
    book = EvalBook(
        EvalConfig(every_steps=1, items_per_request=4),
        num_items=3,
        max_new_tokens=8,
        threshold=1.0,
        reissue_after_s=120.0,
        clock=clock,
    )
    book.schedule(version=1, step=1)
    first = book.next_piece(1)
    clock.advance(119.0)
    assert book.next_piece(1) is None, "within reissue_after_s the piece stays with its generator"
    clock.advance(1.0)
    again = book.next_piece(1)
    assert first.indices == again.indices == [0, 1, 2]


def answered(piece, tokens_each):
    """A report of ``piece``: a greedy answer and ``piece.k`` samples per prompt, each ``tokens_each`` long."""
    traces = [
        EvalTrace(index=i, prompt="p", response="r", answer=None, reward=0.0, version=0, greedy=g, tokens=tokens_each)
        for i in piece.indices
        for g in [True] + [False] * piece.k
    ]
    return EvalReport(generator_id="g", version=piece.version, indices=piece.indices, traces=traces)


def test_under_a_budget_pieces_wait_for_training_tokens_and_an_evaluation_not_begun_gives_way():
    """eval.max_share 0.2: evaluation earns a quarter of the training tokens generated (0.2 / 0.8). A piece of 2
    prompts with k 3 (8 answers) is charged 8 answers at training's mean length when it goes out, and may
    overdraw what was earned."""
    book = EvalBook(EvalConfig(every_steps=10, k=3, items_per_request=2, max_share=0.2), 6, 8, threshold=1.0)
    assert book.schedule(version=0, step=0) == []
    assert book.next_piece(0) is None, "nothing earned before training starts"
    book.generated(samples=4, tokens=40)  # 10 tokens an answer: 10 earned
    first = book.next_piece(0)
    assert first.indices == [0, 1] and book.next_piece(0) is None, "charged 80: -70 left, the next piece waits"
    book.generated(samples=32, tokens=320)  # +280 tokens, +70: back to 0
    assert book.next_piece(0) is None
    book.generated(samples=33, tokens=330)
    assert book.next_piece(0).indices == [2, 3]
    # v10 falls due while v0 is under way: both stay. v20 falls due before v10 began: v10 gives way
    assert book.schedule(version=10, step=10) == []
    assert book.schedule(version=20, step=20) == [10]
    assert book.pending() == 2
    book.lift_budget()  # the final evaluation: no budget
    out = [book.next_piece(20) for _ in range(4)]
    assert [p.version for p in out] == [0, 20, 20, 20] and [p.indices for p in out] == [[4, 5], [0, 1], [2, 3], [4, 5]]


def test_a_piece_is_charged_what_its_answers_took_and_the_next_is_estimated_at_evaluations_length():
    """Early answers run long: training's later ones are short. A piece goes out charged at training's mean
    length (10 tokens); its report says its 8 answers took 40 each, and the book charges the difference."""
    book = EvalBook(EvalConfig(every_steps=10, k=3, items_per_request=2, max_share=0.5), 6, 64, threshold=1.0)
    book.schedule(version=0, step=0)
    book.generated(samples=1, tokens=10)  # 10 earned: credit 10
    first = book.next_piece(0)  # charged 80: credit -70
    book.report(answered(first, tokens_each=40))  # took 320: credit -310
    book.generated(samples=32, tokens=320)  # +310: credit 0
    assert book.next_piece(0) is None, "the answers' own length is charged, not the estimate"
    book.generated(samples=33, tokens=330)  # credit 10
    second = book.next_piece(0)
    assert second.indices == [2, 3]
    book.generated(samples=59, tokens=590)  # +260: credit 10 - 320 + 260 = -50 (at training's 10: +190)
    assert book.next_piece(0) is None, "the next piece is estimated at evaluation's own 40 tokens an answer"
    book.generated(samples=65, tokens=650)
    third = book.next_piece(0)
    assert third.indices == [4, 5]
    book.schedule(version=10, step=10)
    book.report(answered(second, tokens_each=5))  # learned to answer short: 40 tokens, 280 given back
    book.generated(samples=66, tokens=660)  # credit 10 - 320 + 280 + 10 = -20
    assert book.next_piece(10) is None and book.owed() == 20, "v10 waits: evaluation is 20 tokens ahead"
    book.generated(samples=69, tokens=690)  # credit 10: v10's first piece, charged at the latest 5 an answer
    assert book.next_piece(10).indices == [0, 1]
    book.generated(samples=72, tokens=720)  # 40 charged: 0 now; at the all-time mean (22.5 an answer), -140
    assert book.next_piece(10) is None
    book.generated(samples=73, tokens=730)
    assert book.next_piece(10).indices == [2, 3], "estimated at the latest piece's length, not the first's"
    assert book.token_share() == (320 + 40) / (320 + 40 + 730)  # only reported answers count


def test_the_starting_policys_evaluation_goes_out_in_full_at_once_and_the_next_waits_for_what_it_took():
    book = EvalBook(EvalConfig(every_steps=10, k=3, items_per_request=2, max_share=0.2), 6, 8, threshold=1.0)
    book.schedule(version=0, step=0, budgeted=False)
    assert book.schedule(version=10, step=10) == [], "v0 is not skipped, though none of its pieces is out yet"
    pieces = [book.next_piece(0) for _ in range(3)]
    assert [p.indices for p in pieces] == [[0, 1], [2, 3], [4, 5]], "no credit needed"
    for piece in pieces:
        book.report(answered(piece, tokens_each=5))  # 3 x 8 answers of 5 tokens: 120
    assert book.next_piece(10) is None
    book.generated(samples=48, tokens=480)  # earns 120: what v0 took
    assert book.next_piece(10) is None, "v10 waits until training has earned back v0's evaluation"
    book.generated(samples=49, tokens=490)
    assert book.next_piece(10).version == 10


def test_without_a_budget_no_evaluation_is_skipped_and_pieces_go_out_at_once():
    book = EvalBook(EvalConfig(every_steps=10, k=3, items_per_request=2), 4, 8, threshold=1.0)
    book.schedule(version=0, step=0)
    assert book.schedule(version=10, step=10) == []
    assert [book.next_piece(10).version for _ in range(4)] == [0, 0, 10, 10]


def test_earned_evaluation_does_not_pile_up_while_nothing_waits_for_it():
    book = EvalBook(EvalConfig(every_steps=10, k=1, items_per_request=1, max_share=0.5), 3, 8, threshold=1.0)
    book.generated(samples=1000, tokens=10_000)  # 10,000 earned with nothing to evaluate: one piece's worth (20)
    book.schedule(version=5, step=10)
    assert [book.next_piece(5) is not None for _ in range(3)] == [True, False, False]


def test_tokens_given_back_while_nothing_waits_do_not_pile_up_either():
    """A piece charged at max_new_tokens (8 an answer) whose answers took 1 each gives 28 back as its
    evaluation ends: the next evaluation still starts from at most one piece's worth."""
    book = EvalBook(EvalConfig(every_steps=10, k=1, items_per_request=2, max_share=0.5), 2, 8, threshold=1.0)
    book.schedule(version=0, step=0, budgeted=False)
    piece = book.next_piece(0)  # charged 4 answers x 8 (nothing known yet): credit -32
    book.generated(samples=6, tokens=60)  # +60 while v0 is open: 28
    book.report(answered(piece, tokens_each=1))  # took 4: 28 given back, 56, and nothing waits
    book.schedule(version=10, step=10)  # kept to one piece at the latest length (4 answers x 1)
    assert book.next_piece(10) is not None and book.owed() == 0
    book.schedule(version=20, step=20)
    assert book.next_piece(20) is None, "4 kept, 4 spent: v20 waits"


def test_the_shares_count_while_training_runs_and_not_the_final_evaluation():
    book = EvalBook(EvalConfig(every_steps=10, k=1, items_per_request=2, max_share=0.5), 2, 8, threshold=1.0)
    book.schedule(version=0, step=0, budgeted=False)
    book.report(answered(book.next_piece(0), tokens_each=25))  # 4 answers, 100 tokens
    book.generated(samples=30, tokens=300)
    assert (book.share(), book.token_share()) == (4 / 34, 100 / 400)
    book.lift_budget()
    book.schedule(version=40, step=40)
    book.report(answered(book.next_piece(40), tokens_each=25))
    book.generated(samples=60, tokens=600)  # groups generators finish while the final evaluation runs
    assert (book.share(), book.token_share()) == (4 / 34, 100 / 400)


def test_a_reissued_piece_is_charged_again_and_its_report_settles_the_copy_that_answered():
    """A piece whose generator went silent goes out again, charged again: the first copy's estimate stands for
    what the lost generator spent on it, the report settles the second's."""
    clock = FakeClock()
    config = EvalConfig(every_steps=10, k=1, items_per_request=2, max_share=0.5)
    book = EvalBook(config, 4, 8, threshold=1.0, reissue_after_s=60.0, clock=clock)
    book.schedule(version=0, step=0)
    book.generated(samples=10, tokens=100)  # 10 an answer; credit 100
    first = book.next_piece(0)  # charged 4 answers x 10: credit 60
    clock.advance(60.0)
    again = book.next_piece(0)
    assert again.indices == first.indices  # charged 40 more: credit 20
    book.report(answered(again, tokens_each=10))  # took 40, as estimated: 20
    assert book.next_piece(0).indices == [2, 3]  # credit 20 > 0; charged 40 (the latest piece's 10): -20
    assert book.owed() == 20


def test_generators_that_count_no_tokens_keep_evaluation_going_by_answers():
    """Generators of an older version report samples and no tokens: each sample earns as max_new_tokens (8),
    which evaluation's pieces are charged at too, so the budget counts answers rather than stopping."""
    book = EvalBook(EvalConfig(every_steps=10, k=1, items_per_request=2, max_share=0.2), 4, 8, threshold=1.0)
    book.schedule(version=0, step=0)
    book.generated(samples=4, tokens=0)  # 4 x 8 x 0.25: 8 earned
    first = book.next_piece(0)  # 4 answers x 8: 32 charged, -24
    assert first is not None and book.next_piece(0) is None
    book.report(answered(first, tokens_each=0))  # an older generator counts no tokens: the estimate stands
    book.generated(samples=17, tokens=0)  # 13 more: +26, credit 2
    assert book.next_piece(0).indices == [2, 3]


def test_asyncrl_eval_of_a_version_the_run_no_longer_keeps_names_those_it_does(tmp_path, capsys):
    from generators.evaluate import main

    for version in ("v000298", "v000300"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "config.json").write_text("{}")
    assert main([str(ROOT / "configs/quickstart.yaml"), "--weights", str(tmp_path / "v000120")]) == 2
    assert (
        f"--weights {tmp_path / 'v000120'}: no HF model folder there; {tmp_path} holds v000298, v000300"
        in capsys.readouterr().err
    )


def test_asyncrl_eval_prints_its_scores_even_where_the_traces_cannot_be_written(tmp_path, capsys):
    from generators.evaluate import main

    unwritable = tmp_path / "missing-folder" / "eval.jsonl"
    code = main([*eval_args(ROOT / "assets/tiny-llama", tmp_path), "--out", str(unwritable)])
    out, err = capsys.readouterr()
    assert code == 1 and "the traces could not be written to" in err
    result = json.loads(out.strip().splitlines()[-1])
    # The tiny test model has random weights: its greedy answer copies no number.
    assert result["prompts"] == 5 and result["traces"] is None and result["pass@1"] == 0.0


def test_asyncrl_eval_stops_after_its_time_limit_with_everything_it_started(tmp_path):
    import subprocess
    import sys

    weights = tmp_path / "weights-under-test"  # names this evaluation's processes in /proc
    weights.symlink_to(ROOT / "assets/tiny-llama")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.launch.cli",
            "eval",
            str(ROOT / "configs/ci-tiny.yaml"),
            "--weights",
            str(weights),
            "--timeout-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 124, out.stderr[-2000:]
    assert "asyncrl eval: not done after 0.5s (--timeout-s): stopped" in out.stderr
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(weights).encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            pass
    assert left == [], f"processes of the evaluation still running: {left}"


def test_a_version_is_evaluated_once_however_often_it_is_scheduled():
    book = EvalBook(EvalConfig(every_steps=1, items_per_request=4), num_items=3, max_new_tokens=8, threshold=1.0)
    book.schedule(3, 12)
    piece = book.next_piece(3)
    book.report(EvalReport(generator_id="g", version=3, indices=piece.indices, traces=[]))
    assert book.pending() == 0 and [r.version for r in book.finished()] == [3]
    book.schedule(3, 14)  # the run's end, for the version it evaluated already
    assert book.pending() == 0 and book.scheduled(3) and not book.scheduled(4)


def test_the_summary_reads_evaluations_by_step_whatever_order_they_finished_in():
    from learners.evals import eval_summary

    k = load_config(None, []).eval.k
    results = [
        {"step": 20, "version": 20, "pass@1": 1.0, f"pass@{k}": 1.0, "prompts": 5},
        {"step": 0, "version": 0, "pass@1": 0.0, f"pass@{k}": 0.2, "prompts": 5},
    ]
    summary = eval_summary(results, k)
    assert (summary["pass@1_start"], summary["pass@1_final"], summary["pass@1_best"]) == (0.0, 1.0, 1.0)


def test_the_learner_evaluates_the_start_in_full_and_logs_an_evaluation_skipped_under_a_budget(tmp_path, caplog):
    from asyncrl.observe.metrics import MetricsWriter
    from learners.evals import Evaluations

    config = EvalConfig(every_steps=10, k=1, items_per_request=2, max_share=0.1)
    book = EvalBook(config, 4, 8, threshold=1.0)
    evals = Evaluations(book, config, tmp_path, MetricsWriter(tmp_path, tensorboard=False))
    evals.start(version=0, step=0)
    assert book.next_piece(0) is not None, "the starting policy is evaluated without waiting for credit"
    for version in (10, 20):
        evals.stepped(version)
        with caplog.at_level("INFO"):
            evals.published(version, version)
    assert "eval of v10 skipped for v20: eval.max_share left it no tokens yet" in caplog.text
    assert book.pending() == 2  # v0 (under way) and v20


def test_an_evaluation_not_finished_at_a_checkpoint_is_scheduled_again_when_the_run_resumes(tmp_path, caplog):
    """The run stopped with the eval of v10 under way, or owed to the next version: a resumed run evaluates the
    version it resumes with, rather than leaving a gap in eval.jsonl."""
    import msgspec

    from asyncrl.observe.metrics import MetricsWriter
    from learners import checkpoint
    from learners.evals import Evaluations

    config = EvalConfig(every_steps=10, k=1, items_per_request=2)

    def evaluations() -> tuple[EvalBook, Evaluations]:
        book = EvalBook(config, 4, 8, threshold=1.0)
        return book, Evaluations(book, config, tmp_path, MetricsWriter(tmp_path, tensorboard=False))

    book, evals = evaluations()
    evals.start(version=0, step=0)
    evals.stepped(10)
    evals.published(10, 10)
    kept = checkpoint.LearnerState(step=10, version=10, coordinator=None, bound={}, consumed_ids=[])
    kept.evals = evals.unfinished(10)
    assert kept.evals == [(0, 0), (10, 10)]
    kept = msgspec.json.decode(msgspec.json.encode(kept.evals), type=list[tuple[int, int]])  # as checkpointed
    book, resumed = evaluations()
    resumed.results = [{"step": 0, "version": 0, "pass@1": 0.0, "prompts": 4}]  # v0 was answered and written
    resumed.resume(kept, version=10)
    assert book.open() == [(10, 10)]
    # owed to the next version when the run stopped: the resumed version is evaluated
    book, evals = evaluations()
    evals.stepped(20)
    assert evals.unfinished(20) == [(-1, 20)]
    book, resumed = evaluations()
    with caplog.at_level("WARNING"):
        resumed.resume([(-1, 20), (15, 15)], version=20)
    assert book.open() == [(20, 20)]
    assert "the eval of v15 was not finished before the run stopped" in caplog.text
