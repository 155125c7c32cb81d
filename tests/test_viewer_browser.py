"""``asyncrl view`` in a real browser: headless Chromium (Debian's package) driven by Selenium, on the folder of
a real quickstart run. The curves must be drawn with the run's numbers, and a kept rollout's tokens and versions
must be those of rollouts.jsonl, trained at the step consumed.jsonl says. Screenshots go to
``ASYNCRL_SCREENSHOTS`` (docs/images for the README) or the test's folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("view") / "quickstart"
    command = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "run",
        str(ROOT / "configs/quickstart.yaml"),
        "--run-dir",
        str(run),
        "--free-ports",
        "--learner.total_steps=120",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM and CHROMEDRIVER, "needs Debian's chromium and chromium-driver (apt-get install -y ...)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(run_dir, browser):
    from asyncrl.launch.viewer.server import serve

    port = free_port()
    server = serve(run_dir, "127.0.0.1", port, background=True)
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    browser.get(f"http://127.0.0.1:{port}/")
    wait_for(browser, "return document.body.dataset.loaded === '1'")
    yield browser
    server.should_exit = True


def wait_for(browser, script: str, timeout_s: float = 20.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout_s).until(lambda b: b.execute_script(script))


def shots() -> Path:
    folder = Path(os.environ.get("ASYNCRL_SCREENSHOTS") or ROOT / "runs" / "viewer-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_curves_are_drawn_with_the_runs_numbers(page, run_dir):
    metrics = lines(run_dir / "metrics.jsonl")
    drawn = page.execute_script("const d = document.getElementById('chart-reward').data[0]; return [d.x, d.y];")
    assert drawn[0] == [m["step"] for m in metrics]
    assert drawn[1] == pytest.approx([m["reward"] for m in metrics])
    assert page.find_element("id", "run-name").text == "quickstart"
    assert "ended" in page.find_element("id", "run-state").text
    staleness = page.execute_script("return document.getElementById('chart-staleness').data.map(t => t.name)")
    assert staleness == ["staleness 0", "staleness 1"]  # quickstart: max_staleness 1
    page.save_screenshot(str(shots() / "viewer-curves.png"))


def test_a_rollouts_tokens_and_versions_are_those_the_learner_kept_and_trained_on(page, run_dir):
    from selenium.webdriver.common.by import By

    page.find_element(By.CSS_SELECTOR, "nav button[data-view=rollouts]").click()
    wait_for(page, "return document.querySelectorAll('#rollout-table tbody tr').length > 0")
    rows = page.find_elements(By.CSS_SELECTOR, "#rollout-table tbody tr")
    kept = {r["id"]: r for r in lines(run_dir / "rollouts.jsonl")}
    assert len(rows) == min(len(kept), 500)
    trained = [r for r in rows if kept[r.get_attribute("data-id")].get("drop_reason") is None]  # not a dropped one
    row = trained[len(trained) // 2]
    chosen = kept[row.get_attribute("data-id")]
    row.click()
    wait_for(page, f"return document.getElementById('detail-id')?.textContent === {json.dumps(chosen['id'])}")
    spans = page.find_elements(By.CSS_SELECTOR, "#detail-tokens .tok")
    assert [int(s.get_attribute("data-id")) for s in spans] == chosen["response_ids"]
    assert [int(s.get_attribute("data-version")) for s in spans] == chosen["versions"]
    title = spans[0].get_attribute("title")
    assert f"advantage {chosen['advantages'][0]}" in title
    assert f"learner log-prob {chosen['learner_logprobs'][0]}" in title
    consumed = next(c for c in lines(run_dir / "consumed.jsonl") if c["id"] == chosen["id"])
    shown = page.find_element("id", "detail-consumed").text
    assert shown == f"step {consumed['step']}, staleness {consumed['staleness']}"
    assert consumed["step"] == chosen["step"]
    page.save_screenshot(str(shots() / "viewer-rollout.png"))


def test_the_pipeline_view_shows_the_runs_totals(page, run_dir):
    from selenium.webdriver.common.by import By

    page.find_element(By.CSS_SELECTOR, "nav button[data-view=pipeline]").click()
    summary = json.loads((run_dir / "summary.json").read_text())
    text = page.find_element("id", "pipeline-summary").text
    assert f"pipeline_efficiency\n{round(summary['pipeline_efficiency'], 4)}" in text
    page.save_screenshot(str(shots() / "viewer-pipeline.png"))


def test_an_episode_shows_turn_by_turn_and_a_prompts_answers_show_across_versions(page, run_dir):
    """An episode's environment tokens (loss mask 0) and held-out answers at two versions, added to the run's
    files as a multi-turn run and its evaluations would write them."""
    from selenium.webdriver.common.by import By

    episode = json.loads((run_dir / "rollouts.jsonl").read_text().splitlines()[0])
    episode.update(
        id="episode-1",
        response_ids=[5, 6, 7, 8, 9],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        versions=[4, 4, 4, 4, 5],
        loss_mask=[1, 1, 0, 0, 1],
        advantages=[1.0, 1.0, 0.0, 0.0, 1.0],
        learner_logprobs=[-0.1, -0.2, -5.0, -6.0, -0.3],
    )
    with (run_dir / "rollouts.jsonl").open("a") as out:
        out.write(json.dumps(episode) + "\n")
    page.find_element(By.CSS_SELECTOR, "nav button[data-view=rollouts]").click()
    page.execute_script("showRollout('episode-1')")
    wait_for(page, "return document.getElementById('detail-id')?.textContent === 'episode-1'")
    turns = [t.text for t in page.find_elements(By.CSS_SELECTOR, "#detail-tokens .turn")]
    assert turns == ["model", "environment (not trained on)", "model"]
    env = page.find_elements(By.CSS_SELECTOR, "#detail-tokens .tok.env")
    assert [int(t.get_attribute("data-id")) for t in env] == [7, 8]

    (run_dir / "eval").mkdir(exist_ok=True)
    for version, answer, reward in ((0, "12", 0.0), (60, "7", 1.0)):
        traces = [
            {
                "index": 2,
                "prompt": "copy 7",
                "response": f"answer {answer}",
                "answer": answer,
                "reward": reward,
                "version": version,
                "greedy": greedy,
            }
            for greedy in (True, False, False)
        ]
        (run_dir / "eval" / f"v{version:06d}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    page.find_element(By.CSS_SELECTOR, "nav button[data-view=evaluation]").click()
    page.find_element(By.ID, "e-index").clear()
    page.find_element(By.ID, "e-index").send_keys("2")
    page.find_element(By.ID, "e-apply").click()
    wait_for(page, "return document.querySelectorAll('#eval-table tbody tr').length === 2")
    rows = page.find_elements(By.CSS_SELECTOR, "#eval-table tbody tr")
    assert [r.get_attribute("data-version") for r in rows] == ["0", "60"]
    assert rows[1].find_elements(By.TAG_NAME, "td")[1].text == "7 1"


def test_the_learners_log_probs_are_kept_and_on_policy_they_are_the_behaviours(run_dir):
    """A rollout sampled entirely by the version the learner held at its step: the two sides' log-probs of the
    same tokens under the same weights agree (fp32 on CPU); older ones differ by what the policy learned."""
    # the learner's (not a test's), trained on (a dropped one has no learner log-probs)
    kept = [r for r in lines(run_dir / "rollouts.jsonl") if r["id"] != "episode-1" and r.get("drop_reason") is None]
    assert all(len(r["learner_logprobs"]) == len(r["response_ids"]) for r in kept)
    on_policy = [r for r in kept if set(r["versions"]) == {r["version"]}]  # version: the learner's at its step
    assert on_policy  # the first step (max_staleness 1: the later ones train on rollouts one version old)
    gap = max(abs(a - b) for r in on_policy for a, b in zip(r["learner_logprobs"], r["logprobs"]))
    assert gap < 2e-3, gap
    stale = [r for r in kept if max(r["versions"]) < r["version"]]
    assert stale and max(abs(a - b) for r in stale for a, b in zip(r["learner_logprobs"], r["logprobs"])) > 0.01


def test_several_runs_are_picked_at_the_top_of_one_page(run_dir, browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    from asyncrl.launch.viewer.server import serve

    other = tmp_path / "other"  # the same run cut at step 30, as a second run beside it
    shutil.copytree(run_dir, other)
    (other / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:30])
    )
    port = free_port()
    server = serve([run_dir, other], "127.0.0.1", port, background=True)
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        browser.get(f"http://127.0.0.1:{port}/")
        wait_for(
            browser,
            "return document.body.dataset.loaded === '1' "
            "&& !document.getElementById('run-pick').classList.contains('hidden')",
        )
        picker = Select(browser.find_element("id", "run-pick"))
        assert [o.text for o in picker.options] == ["quickstart", "other"]
        steps = len(lines(run_dir / "metrics.jsonl"))
        assert browser.execute_script("return document.getElementById('chart-reward').data[0].x.length") == steps
        picker.select_by_visible_text("other")
        wait_for(browser, "return location.search === '?run=1' && document.body.dataset.loaded === '1'")
        wait_for(browser, "return document.getElementById('chart-reward').data?.[0]?.x.length === 30")
        assert Select(browser.find_element("id", "run-pick")).first_selected_option.text == "other"
    finally:
        server.should_exit = True
