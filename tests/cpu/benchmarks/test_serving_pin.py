"""The serving benchmarks give the target replicas a core of their own (`pin_target_replicas`)."""

import os
import subprocess

import pytest

from outrider.benchmarks import bench_serving


@pytest.mark.skipif(len(bench_serving._CORES) < 2, reason="pinning needs at least two cores")
def test_the_measured_applications_target_gets_the_last_core_alone():
    cores = bench_serving._CORES
    target = subprocess.Popen(["ray::ServeReplica:app:TargetWorker", "30"], executable="sleep")
    # (busy: Ray's title names the method it runs)
    idle = subprocess.Popen(
        ["ray::ServeReplica:other:TargetWorker.handle_request_with_rejection", "30"], executable="sleep"
    )
    ingress = subprocess.Popen(["ray::ServeReplica:app:OpenAIIngress", "30"], executable="sleep")
    try:
        assert bench_serving.pin_target_replicas("app") == 1
        assert os.sched_getaffinity(target.pid) == {cores[-1]}
        assert os.sched_getaffinity(idle.pid) == set(cores[:-1])  # off the measured one's core
        assert os.sched_getaffinity(ingress.pid) == set(cores)  # not a target: not moved
        assert os.sched_getaffinity(0) == set(cores)  # the caller is left alone
        assert bench_serving.pin_target_replicas("other") == 1
        assert os.sched_getaffinity(target.pid) == set(cores[:-1])
        assert os.sched_getaffinity(idle.pid) == {cores[-1]}
    finally:
        for process in (target, idle, ingress):
            process.kill()


@pytest.mark.skipif(len(bench_serving._CORES) < 2, reason="pinning needs at least two cores")
def test_the_benchmark_process_gets_its_cores_back():
    bench_serving._pin_process(os.getpid(), bench_serving._serving_cores())
    try:
        assert os.sched_getaffinity(0) == set(bench_serving._CORES[:-1])
    finally:
        bench_serving.unpin()
    assert os.sched_getaffinity(0) == set(bench_serving._CORES)
