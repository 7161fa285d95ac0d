"""The live progress line of `slicewise train` and `watch` at the widths people's
terminals have: the step count, the loss and the time remaining always show; the bar
goes first when the line is narrow, then the step time and tokens/s."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from controller.jobview import BAR_MIN, _JobProgress, progress_parts

HEAD = "j4-xlglywkrvzlf7 running"
COUNT, LOSS, REMAINING = "20/40", "loss 5.5287", "0:00:12"
EXTRAS = ("394 ms/step", "2,597 tok/s")


def parts(width):
    return progress_parts(HEAD, COUNT, LOSS, EXTRAS, REMAINING, width)


@pytest.mark.parametrize("width", [40, 60, 80, 100, 120, 200])
def test_the_line_fits_and_keeps_the_step_loss_and_time(width):
    head, bar, right = parts(width)
    assert head == HEAD
    for must in (COUNT, LOSS, REMAINING):
        assert must in right
    used = len(head) + len(right) + (bar + 2 if bar else 1)
    assert used <= max(width, len(HEAD) + len(f"{COUNT}  {LOSS}  {REMAINING}") + 1)


def test_the_bar_goes_first_then_the_tokens_then_the_step_time():
    assert parts(120)[1] >= BAR_MIN and "tok/s" in parts(120)[2]
    head, bar, right = parts(80)
    assert bar == 0 and "ms/step" in right and "tok/s" in right
    head, bar, right = parts(70)
    assert bar == 0 and "ms/step" in right and "tok/s" not in right
    head, bar, right = parts(50)
    assert bar == 0 and "ms/step" not in right


def rendered(width: int) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    progress = _JobProgress(console=console, auto_refresh=False)
    task = progress.add_task(HEAD, total=40, loss=LOSS, extras=EXTRAS)
    progress.update(task, completed=20)
    console.print(progress.get_renderable())
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize("width", [60, 80, 120])
def test_what_a_terminal_of_that_width_shows(width):
    (line,) = rendered(width)
    assert len(line) <= width
    assert line.startswith(HEAD)
    assert COUNT in line and LOSS in line and "…" not in line
    assert ("━" in line) is (width >= 120)
