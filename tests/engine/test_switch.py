"""The GIL switch interval is shared by engines: set while any runs, restored when the last closes."""

import sys

import pytest

from foveal.engine import Engine, EngineConfig
from foveal.testing import FakeRunner


def _engine(interval: float) -> Engine:
    return Engine(FakeRunner(vocab_size=64), None, EngineConfig(switch_interval=interval, num_pages=8))


def test_engines_closed_out_of_order_restore_the_original_interval():
    # Intervals below the default 1e-4: engines other tests left running (session fixtures) hold
    # at most that, so these two decide the interval while they run.
    original = sys.getswitchinterval()
    a = _engine(1e-6)
    b = _engine(5e-6)
    assert sys.getswitchinterval() == pytest.approx(1e-6)  # the shortest asked for while both run
    a.close()
    assert sys.getswitchinterval() == pytest.approx(5e-6)
    b.close()
    b.close()  # a second close releases nothing
    assert sys.getswitchinterval() == pytest.approx(original)
