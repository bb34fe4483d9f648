"""Screenshot a run's lineage page as the MLflow UI shows it (how docs/lineage.png was taken).

    .venv/bin/python scripts/screenshot_lineage.py http://127.0.0.1:5000 RUN_ID docs/lineage.png

Needs a running MLflow UI/server with the run, and Debian's `chromium` (scripts/setup.sh installs it).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlflow.tracking import MlflowClient  # noqa: E402

from tests.browser import Browser, find_chromium  # noqa: E402
from tests.waiting import wait_for  # noqa: E402


def main(server: str, run_id: str, out: str, width: int = 1600, height: int = 1000) -> None:
    experiment = MlflowClient(server).get_run(run_id).info.experiment_id
    browser = Browser(find_chromium() or sys.exit("no chromium on PATH"), width, height)
    try:
        browser.navigate(f"{server}/#/experiments/{experiment}/runs/{run_id}/artifacts/lineage/lineage.html")
        wait_for(lambda: browser.frame_evaluate("blob:", "!!document.getElementById('selected-hash')"), 120,
                 "the lineage page in the MLflow UI", tolerate=(RuntimeError,))
        # make room: close the assistant panel and collapse the sidebar, where the UI shows them
        browser.evaluate("""for (const label of ['Close', 'Toggle sidebar']) {
            const b = [...document.querySelectorAll('button')].find(x => x.getAttribute('aria-label') === label);
            if (b) b.click(); }""")
        time.sleep(2)  # Plotly refits to the wider frame
        browser.screenshot(Path(out))
    finally:
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
