"""A short soak (the long one is `hetccl bench soak`, default 120 s): randomised collectives
over three emulated vendors, all verified, no leaks."""
from hetccl.bench import soak


def test_short_soak_is_clean(capsys):
    rc = soak.main(["--seconds", "6", "--vendors", "2+1+1", "--no-progress"])
    out = capsys.readouterr().out
    assert "wrong results     : 0" in out, out
    assert "leaks             : 0" in out, out
    assert rc == 0, out
