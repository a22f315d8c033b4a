"""headway.progress: plain lines with rate and ETA off a terminal, a bar on one."""

import io
import re

from headway.progress import Progress, clock, default_every

LINE = re.compile(r"^job: (\d+)/10 steps \(\d+%\) \| [\d.e+-]+ steps/s(, [\d,]+ tok/s)? \| elapsed \d+:\d\d \| "
                  r"ETA (\d+:\d\d|\?)( \| .*)?$")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_file_gets_a_line_every_n_items_with_rate_and_eta():
    out = io.StringIO()
    with Progress("job", 10, unit="steps", every=3, stream=out, interval_s=1e9) as p:
        for i in range(10):
            p.advance(1, tokens=5, info=f"loss {i}")
    lines = out.getvalue().splitlines()
    assert [int(LINE.match(x).group(1)) for x in lines] == [3, 6, 9, 10]  # every 3, and the end
    assert all("tok/s" in x and "ETA" in x for x in lines)
    assert lines[-1].endswith("ETA 0:00 | loss 9")


def test_a_job_stopped_early_prints_where_it_stopped():
    out = io.StringIO()
    with Progress("job", 10, unit="steps", every=4, stream=out, interval_s=1e9) as p:
        p.update(5)
    assert [int(LINE.match(x).group(1)) for x in out.getvalue().splitlines()] == [5]


def test_a_resumed_job_rates_only_this_session():
    p = Progress("job", 10, unit="steps", completed=6, stream=io.StringIO())
    assert p.rate == 0 and p.eta() is None and "ETA ?" in p.line()
    p.update(8)
    assert p.rate > 0 and p.eta() is not None


def test_a_terminal_gets_a_bar_and_disabled_progress_prints_nothing():
    tty = Terminal()
    with Progress("job", 10, unit="steps", every=1, stream=tty) as p:
        assert p.bar is not None
        p.advance(10)
    assert not any(LINE.match(x) for x in tty.getvalue().splitlines())
    quiet = io.StringIO()
    with Progress("job", 10, every=1, stream=quiet, enabled=False) as p:
        p.advance(10)
    assert quiet.getvalue() == ""


def test_helpers():
    assert clock(75) == "1:15" and clock(3725) == "1:02:05" and clock(-3) == "0:00"
    assert default_every(7) == 1 and default_every(1000) == 50
