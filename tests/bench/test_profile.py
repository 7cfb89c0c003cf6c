"""XLA profiler traces: ``/start_profile`` around N engine steps of a live server, and the
offline benches' ``--profile-dir`` (``StepProfiler``)."""

import time

import pytest
from bench_common import StepProfiler, http_json, trace_files

pytestmark = pytest.mark.slow      # starts processes (README: the fast tier starts none)


def test_start_profile_num_steps_writes_xplane_and_stops_itself(deployment, tmp_path):
    url = deployment["colocated"]
    ans = http_json(url + "/start_profile", {"output_dir": str(tmp_path), "num_steps": 3})
    assert ans == {"success": True, "trace_dir": str(tmp_path)}
    model = http_json(url + "/v1/models")["data"][0]["id"]
    out = http_json(url + "/v1/completions", {"model": model, "prompt": list(range(10, 30)),
                                               "max_tokens": 6, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 6           # 6 steps: the trace stopped after 3
    deadline = time.monotonic() + 30
    while not trace_files(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    files = trace_files(str(tmp_path))
    assert len(files) == 1 and files[0].startswith(str(tmp_path / "plugins" / "profile"))
    assert (tmp_path / "plugins").stat().st_size > 0
    # The profile ended by itself after 3 steps: there is nothing left to stop.
    with pytest.raises(RuntimeError, match="no profile is running"):
        http_json(url + "/stop_profile", {})


def test_profile_dir_flag_is_the_default_trace_dir(deployment, server_profile_dir):
    url = deployment["colocated"]
    ans = http_json(url + "/start_profile", {})
    assert ans["trace_dir"] == str(server_profile_dir)
    model = http_json(url + "/v1/models")["data"][0]["id"]
    http_json(url + "/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 2})
    assert http_json(url + "/stop_profile", {})["trace_dir"] == str(server_profile_dir)
    files = trace_files(str(server_profile_dir))
    assert len(files) == 1 and files[0].endswith(".xplane.pb")


def test_a_trace_folder_that_cannot_be_written_is_refused_and_leaves_no_profile(
        deployment, tmp_path):
    """A file as output_dir was accepted, then the trace failed to export at the stop and
    left the profiler started for good (every later start: "already started")."""
    url = deployment["colocated"]
    not_a_folder = tmp_path / "trace.txt"
    not_a_folder.write_text("x")
    for bad in (str(not_a_folder), "/proc/traces"):
        with pytest.raises(RuntimeError, match="output_dir: "):
            http_json(url + "/start_profile", {"output_dir": bad})
    with pytest.raises(RuntimeError, match="no profile is running"):
        http_json(url + "/stop_profile", {})
    good = tmp_path / "new" / "traces"            # made when missing
    assert http_json(url + "/start_profile", {"output_dir": str(good)})["success"]
    assert http_json(url + "/stop_profile", {})["trace_dir"] == str(good)
    assert len(trace_files(str(good))) == 1


class _Runner:
    def __init__(self):
        self.calls = []

    def start_profile(self, output_dir):
        self.calls.append(("start", output_dir))

    def stop_profile(self):
        self.calls.append(("stop",))


class _Core:
    def __init__(self):
        self.runner, self.step_hooks = _Runner(), []


def test_step_profiler_stops_after_num_steps():
    core = _Core()
    prof = StepProfiler(core, "/tmp/x", num_steps=2)
    prof.start()
    assert core.runner.calls == [("start", "/tmp/x")] and len(core.step_hooks) == 1
    for hook in list(core.step_hooks):
        hook(None, [])
    assert core.runner.calls == [("start", "/tmp/x")]
    for hook in list(core.step_hooks):
        hook(None, [])
    assert core.runner.calls == [("start", "/tmp/x"), ("stop",)] and core.step_hooks == []
    prof.stop()                                             # idempotent
    assert len(core.runner.calls) == 2
    with pytest.raises(ValueError, match="num_steps"):
        StepProfiler(core, "/tmp/x", num_steps=0)
