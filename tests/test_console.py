import io

from mlxtune.console import Console


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_shows_eta_on_a_terminal_and_log_lines_clear_it():
    out = FakeTTY()
    con = Console(stream=out)
    con.start_progress(10)
    con.advance(4, 1.2345)
    assert "4/10" in out.getvalue() and "ETA" in out.getvalue() and "loss 1.2345" in out.getvalue()
    con.log_step(
        {
            "step": 4,
            "loss": 1.2,
            "lr": 1e-3,
            "grad_norm": 0.5,
            "tokens_per_sec": 1234.0,
            "peak_memory_gb": 0.1,
        },
        10,
    )
    last = out.getvalue().split("\r\033[K")[-1]
    assert last.startswith("step      4/10 | loss 1.2000 | lr 1.00e-03 | grad 0.500 | 1,234 tok/s")


def test_no_progress_bar_when_not_a_terminal():
    out = io.StringIO()
    con = Console(stream=out)
    con.start_progress(10)
    con.advance(4, 1.0)
    assert out.getvalue() == ""
    con.info("hello")
    assert out.getvalue() == "hello\n"
