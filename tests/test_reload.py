"""ConfigWatcher: changing the config file during training."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

import trainmon.config.watch as reload_mod
from trainmon.config import load_config
from trainmon.config.load import parse_config_text
from trainmon.config.watch import ConfigChange, ConfigWatcher, dynamic_from_env

IGNORED = "ignoring the edit"


def write(path, data, bump=True):
    """Write a config and move its mtime forward, so no test has to sleep for mtime granularity."""
    before = os.stat(path).st_mtime_ns if path.exists() else 0
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    if bump:
        t = max(before, os.stat(path).st_mtime_ns) + 1_000_000_000
        os.utime(path, ns=(t, t))


def warnings_about(caplog, text):
    return [r for r in caplog.records if r.name == "trainmon" and text in r.getMessage()]


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "monitor.json"
    write(path, {"wg_distribution": True}, bump=False)
    return path


@pytest.fixture
def counted_loads(monkeypatch):
    """The versions of the file the watcher read and parsed."""
    calls = []

    def counting(data, file):
        calls.append(file)
        return parse_config_text(data, file)

    monkeypatch.setattr(reload_mod, "parse_config_text", counting)
    return calls


def plain(path, **kw):
    """A watcher reading a changed file at the first look (settle_s=0): these tests are about what it
    reads; the settling of a file being written is tested on its own below."""
    return ConfigWatcher(path, load_config(path), dynamic=False, **{"settle_s": 0, **kw})


def test_no_change_does_not_reread(cfg_file, counted_loads):
    w = plain(cfg_file)
    assert [w.check() for _ in range(5)] == [None] * 5
    assert counted_loads == []


def test_valid_edit_is_reported_once(cfg_file, counted_loads):
    w = plain(cfg_file)
    write(cfg_file, {"wg_distribution": True, "param_distribution": True})
    change = w.check()
    assert isinstance(change, ConfigChange)
    assert change.enabled is True
    assert change.config.param_distribution
    assert w.current is change.config
    assert w.check() is None
    assert len(counted_loads) == 1


def test_equal_config_is_no_change(cfg_file, counted_loads):
    w = plain(cfg_file)
    write(cfg_file, '{"wg_distribution": true, "ops": []}')  # same config, different text
    assert w.check() is None
    assert len(counted_loads) == 1
    assert w.check() is None
    assert len(counted_loads) == 1


def test_bad_edit_warns_once_then_valid_edit_applies(cfg_file, caplog, counted_loads):
    w = plain(cfg_file)
    before = w.current
    write(cfg_file, '{"wg_distribution": tru')
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert [w.check() for _ in range(4)] == [None] * 4
    found = warnings_about(caplog, IGNORED)
    assert len(found) == 1
    assert str(cfg_file) in found[0].getMessage()
    assert "invalid JSON" in found[0].getMessage()
    assert w.current is before
    assert len(counted_loads) == 1  # the bad version is not re-read either

    write(cfg_file, {"wg_distribution": True, "step_interval": 0})
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert w.check() is None
    assert "step_interval" in warnings_about(caplog, IGNORED)[-1].getMessage()

    write(cfg_file, {"mv_distribution": True})
    change = w.check()
    assert change is not None and change.config.mv_distribution and not change.config.wg_distribution
    assert len(warnings_about(caplog, IGNORED)) == 2


def test_atomic_replace_is_detected(cfg_file, tmp_path):
    w = plain(cfg_file)
    tmp = tmp_path / "monitor.json.tmp"
    write(tmp, {"xy_distribution": True}, bump=False)
    t = os.stat(cfg_file).st_mtime_ns + 1_000_000_000
    os.utime(tmp, ns=(t, t))
    os.replace(tmp, cfg_file)
    change = w.check()
    assert change is not None and change.config.xy_distribution


def test_missing_file_briefly_is_silent(cfg_file, caplog):
    w = plain(cfg_file)
    before = w.current
    cfg_file.unlink()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert w.check() is None
        assert caplog.records == []
        write(cfg_file, {"ur_distribution": True})
        change = w.check()
    assert change is not None and change.config.ur_distribution
    assert before != change.config
    assert caplog.records == []


def test_missing_file_warns_once_on_the_second_check(cfg_file, caplog):
    w = plain(cfg_file)
    cfg_file.unlink()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert w.check() is None
        assert caplog.records == []
        assert [w.check() for _ in range(3)] == [None] * 3
    found = warnings_about(caplog, "cannot read config file")
    assert len(found) == 1 and str(cfg_file) in found[0].getMessage()
    # Back again with the same content: nothing to apply, and a later disappearance warns again.
    write(cfg_file, {"wg_distribution": True})
    assert w.check() is None
    cfg_file.unlink()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        w.check()
        w.check()
    assert len(warnings_about(caplog, "cannot read config file")) == 2


def test_dynamic_mode_switches_on_dynamic_on(cfg_file):
    write(cfg_file, {"wg_distribution": True, "dynamic_on": False})
    w = ConfigWatcher(cfg_file, load_config(cfg_file), dynamic=True, settle_s=0)
    assert w.enabled is False
    assert w.check() is None  # read once at start: says off, and monitoring already is off
    assert w.check() is None

    write(cfg_file, {"wg_distribution": True, "param_distribution": True, "dynamic_on": False})
    change = w.check()
    assert change == ConfigChange(config=w.current, enabled=False)
    assert change.config.param_distribution

    write(cfg_file, {"wg_distribution": True, "param_distribution": True, "dynamic_on": True})
    change = w.check()
    assert change is not None and change.enabled is True and w.enabled is True
    assert w.check() is None

    write(cfg_file, {"wg_distribution": True, "param_distribution": True, "dynamic_on": False})
    change = w.check()
    assert change is not None and change.enabled is False


def test_dynamic_mode_file_already_on_at_start(cfg_file):
    # msprobe reads the file at the first step end even if nobody edited it.
    write(cfg_file, {"wg_distribution": True, "dynamic_on": True})
    w = ConfigWatcher(cfg_file, load_config(cfg_file), dynamic=True, settle_s=0)
    change = w.check()
    assert change is not None and change.enabled is True and change.config.wg_distribution
    assert w.check() is None


def test_plain_mode_ignores_dynamic_on(cfg_file):
    w = plain(cfg_file)
    write(cfg_file, {"wg_distribution": True, "dynamic_on": False, "mv_distribution": True})
    change = w.check()
    assert change is not None and change.enabled is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        (" Yes ", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("", False),
        ("on", False),
        (None, False),
    ],
)
def test_dynamic_env(monkeypatch, cfg_file, value, expected):
    assert dynamic_from_env({} if value is None else {"DYNAMIC_MONITOR": value}) is expected
    if value is None:
        monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    else:
        monkeypatch.setenv("DYNAMIC_MONITOR", value)
    w = ConfigWatcher(cfg_file, load_config(cfg_file))
    assert w.dynamic is expected
    assert w.enabled is (not expected)
    # The explicit argument wins over the environment.
    assert ConfigWatcher(cfg_file, load_config(cfg_file), dynamic=not expected).dynamic is (not expected)


def test_min_interval_uses_clock(cfg_file):
    now = [0.0]
    w = ConfigWatcher(
        cfg_file, load_config(cfg_file), dynamic=False, clock=lambda: now[0], min_interval=5, settle_s=0
    )
    assert w.check() is None
    write(cfg_file, {"mv_distribution": True})
    now[0] = 1.0
    assert w.check() is None  # too soon to look
    now[0] = 6.0
    change = w.check()
    assert change is not None and change.config.mv_distribution


def test_yaml_file_and_tilde_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "monitor.yaml"
    write(path, "wg_distribution: true\n", bump=False)
    w = ConfigWatcher("~/monitor.yaml", load_config(path), dynamic=False, settle_s=0)
    assert w.path == str(path)
    write(path, "wg_distribution: true\neps: 1e-6\n")
    change = w.check()
    assert change is not None and change.config.eps == 1e-6


# --- a file caught while it is being written (truncate-then-write editors) ---------------------------------


def test_empty_file_is_an_edit_in_progress_not_all_defaults(cfg_file, caplog, counted_loads):
    w = ConfigWatcher(cfg_file, load_config(cfg_file), dynamic=False)  # the default settle time
    before = w.current
    write(cfg_file, "")  # truncated by the editor, not written yet
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert w.check() is None
        time.sleep(reload_mod.SETTLE_S * 1.5)
        assert [w.check() for _ in range(3)] == [None] * 3  # settled, and still empty: kept, said once
    assert w.current is before and before.wg_distribution
    assert counted_loads == []
    found = warnings_about(caplog, "is empty")
    assert len(found) == 1 and str(cfg_file) in found[0].getMessage()
    write(cfg_file, {"wg_distribution": True, "mv_distribution": True})
    assert w.check() is None  # first look at the new version
    time.sleep(reload_mod.SETTLE_S * 1.5)
    change = w.check()
    assert change is not None and change.config.mv_distribution and change.config.wg_distribution


def test_a_version_is_read_only_after_it_kept_still_for_settle_s(cfg_file, counted_loads):
    now = [0.0]
    w = ConfigWatcher(cfg_file, load_config(cfg_file), dynamic=False, clock=lambda: now[0], settle_s=0.02)
    # a YAML-ish editor writing line by line: the first line alone would load (every other key default)
    write(cfg_file, '{"xy_distribution": true}')
    assert w.check() is None
    now[0] += 0.01
    assert w.check() is None  # not settled yet
    write(cfg_file, '{"xy_distribution": true, "wg_distribution": true, "step_interval": 2}')
    now[0] += 0.015
    assert w.check() is None  # another version: its own 20 ms start now
    now[0] += 0.015
    assert w.check() is None
    assert counted_loads == []  # neither version was read
    now[0] += 0.01
    change = w.check()
    assert change is not None
    assert (change.config.xy_distribution, change.config.wg_distribution, change.config.step_interval) == (
        True,
        True,
        2,
    )
    assert len(counted_loads) == 1 and w.check() is None


def test_file_replaced_by_one_of_the_same_size_and_time_is_seen(cfg_file, tmp_path):
    """The inode tells an atomic replace from the version before it."""
    w = plain(cfg_file)
    st = os.stat(cfg_file)
    aside = tmp_path / "aside.json"
    aside.write_text('{"mv_distribution": true}'.ljust(st.st_size))
    os.utime(aside, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(aside).st_size == st.st_size
    os.replace(aside, cfg_file)
    change = w.check()
    assert change is not None and change.config.mv_distribution
