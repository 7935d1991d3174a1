"""handler/admission.py (the load-balancing server's limit on requests) and Settings.endpoint_mode (which kind of
endpoint a worker serves), without processes."""

from __future__ import annotations

import asyncio

import pytest

from handler.admission import Admission, Closed, Overloaded, WaitedTooLong
from handler.settings import load_settings


def test_endpoint_mode_rule():
    mode = lambda **env: load_settings(env).endpoint_mode()  # noqa: E731
    assert mode() == ("queue", "neither RUNPOD_ENDPOINT_TYPE, RUNPOD_WEBHOOK_GET_JOB nor PORT is set")
    assert mode(PORT="8080")[0] == "lb"
    # a queue worker (Runpod and handler.local always set the webhook) never turns LB because PORT is set
    got = mode(PORT="8080", RUNPOD_WEBHOOK_GET_JOB="http://x/job-take/$ID")
    assert got == ("queue", "RUNPOD_WEBHOOK_GET_JOB is set (PORT is ignored)")
    assert mode(RUNPOD_ENDPOINT_TYPE="lb")[0] == "lb"
    assert "ignored" in mode(RUNPOD_ENDPOINT_TYPE="lb", RUNPOD_WEBHOOK_GET_JOB="http://x")[1]
    assert mode(RUNPOD_ENDPOINT_TYPE="queue", PORT="8080")[0] == "queue"
    assert mode(RUNPOD_ENDPOINT_TYPE="", PORT="")[0] == "queue"  # empty is unset
    from handler.settings import SettingsError

    with pytest.raises(SettingsError, match="RUNPOD_ENDPOINT_TYPE"):
        load_settings({"RUNPOD_ENDPOINT_TYPE": "balanced"})
    with pytest.raises(SettingsError, match="PORT"):
        load_settings({"PORT": "70000"})


def _run(coro):
    return asyncio.run(coro)


def test_slots_then_a_bounded_wait_list_then_429_at_once():
    async def main():
        adm = Admission(running=2, waiting=1, max_wait_s=5)
        a, b = adm.enter(), adm.enter()
        await a.wait(), await b.wait()  # free slots: no wait
        c = adm.enter()  # the one wait place
        with pytest.raises(Overloaded, match="2 requests running.*1 waiting") as e:
            adm.enter()
        assert e.value.retry_after_s >= 1
        waiter = asyncio.ensure_future(c.wait())
        await asyncio.sleep(0.01)
        assert not waiter.done() and adm.active == 2
        a.leave()  # its slot goes to c
        await asyncio.wait_for(waiter, 1)
        assert adm.active == 2 and adm.queued == 0
        a.leave()  # idempotent
        assert adm.active == 2
        b.leave(), c.leave()
        assert adm.active == 0

    _run(main())


def test_waiters_are_served_in_order_and_a_long_wait_is_refused():
    async def main():
        adm = Admission(running=1, waiting=3, max_wait_s=0.2)
        first = adm.enter()
        waits = [adm.enter() for _ in range(3)]
        order = []

        async def run(i, t):
            await t.wait()
            order.append(i)

        tasks = [asyncio.ensure_future(run(i, t)) for i, t in enumerate(waits)]
        await asyncio.sleep(0.01)
        first.leave()
        await asyncio.sleep(0.01)
        waits[0].leave()
        await asyncio.sleep(0.01)
        # waits[2] is still waiting when max_wait_s passes: refused, and its place is given up
        with pytest.raises(WaitedTooLong, match="waited 0.2 s"):
            await asyncio.gather(*tasks)
        assert order == [0, 1]
        waits[1].leave()
        assert adm.active == 0 and adm.queued == 0

    _run(main())


def test_a_waiter_that_goes_away_gives_up_its_place():
    async def main():
        adm = Admission(running=1, waiting=1, max_wait_s=10)
        first = adm.enter()
        second = adm.enter()
        task = asyncio.ensure_future(second.wait())
        await asyncio.sleep(0.01)
        task.cancel()  # the client left while waiting
        with pytest.raises(asyncio.CancelledError):
            await task
        assert adm.queued == 0
        third = adm.enter()  # the place is free again
        first.leave()
        await asyncio.wait_for(third.wait(), 1)
        assert adm.active == 1

    _run(main())


def test_close_turns_the_waiters_away_at_once_and_every_later_request():
    async def main():
        adm = Admission(running=1, waiting=2, max_wait_s=30)
        running = adm.enter()
        waiting = [adm.enter() for _ in range(2)]
        tasks = [asyncio.ensure_future(t.wait()) for t in waiting]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            adm.enter()
        adm.close("the worker is shutting down")
        for task in tasks:  # not after max_wait_s: now
            with pytest.raises(Closed, match="shutting down"):
                await asyncio.wait_for(task, 0.1)
        with pytest.raises(Closed):
            adm.enter()
        for t in waiting:  # they never held a slot: leaving changes no count
            t.leave()
        assert adm.active == 1 and adm.queued == 0
        running.leave()  # the running one keeps its slot until it ends
        assert adm.active == 0
        assert dict(adm.refused) == {"overloaded": 1, "closed": 3}

    _run(main())


def test_retry_after_follows_the_requests_time():
    adm = Admission(running=1, waiting=0, max_wait_s=1)
    for _ in range(100):
        adm.observe(7.2)
    assert adm.retry_after() == 8
    for _ in range(100):
        adm.observe(0.01)
    assert adm.retry_after() == 1


def test_an_invalid_variable_still_leaves_the_endpoint_kind_known():
    from handler.settings import serving_settings

    settings, error = serving_settings({"PORT": "8080", "MAX_MODEL_LEN": "lots", "API_KEY": "k"})
    assert settings.endpoint_mode()[0] == "lb" and settings.API_KEY.get_secret_value() == "k"
    assert "MAX_MODEL_LEN" in error
    # an invalid serving variable is dropped, the others kept: a queue worker keeps its webhook
    hook = "http://127.0.0.1:9/job"
    settings, error = serving_settings({"PORT": "eighty", "RUNPOD_WEBHOOK_GET_JOB": hook, "MAX_MODEL_LEN": "lots"})
    assert settings.endpoint_mode()[0] == "queue" and settings.RUNPOD_WEBHOOK_GET_JOB == hook
    assert error and settings.PORT is None
    settings, error = serving_settings({"RUNPOD_ENDPOINT_TYPE": "lbx", "PORT": "8080"})
    assert settings.endpoint_mode()[0] == "lb" and "RUNPOD_ENDPOINT_TYPE" in error
    assert serving_settings({"PORT": "8080"})[1] is None


def test_ping_follows_the_worker_state():
    """handler/lb.py's health check over its states, in process (no engine: a stand-in Worker with its fields)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from handler.lb import LBServer, _Guard, create_app

    lb = LBServer(load_settings({"PORT": "8080", "RUNPOD_POD_ID": "pod-1", "API_KEY": "k"}))
    client = TestClient(_Guard(create_app(lb), lb))
    r = client.get("/ping")
    assert r.status_code == 204 and r.headers["x-runpod-worker-id"] == "pod-1"  # starting; no key needed
    r = client.post("/v1/completions", json={}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 503 and "still starting" in r.json()["error"]["message"]
    lb.worker, lb.state = SimpleNamespace(fault=None, start_error=None, unhealthy=None), "ready"
    assert client.get("/ping").status_code == 200
    lb.worker.fault = "engine step failed: boom"
    r = client.get("/ping")
    assert r.status_code == 503 and "boom" in r.json()["reason"]
    lb.worker.fault, lb.state = None, "shutting down"
    assert client.get("/ping").status_code == 503
    lb.state, lb.worker.start_error = "failed", "ModelNotFoundError: nope"
    assert "nope" in client.get("/ping").json()["reason"]
    assert client.get("/metrics").status_code == 401  # the key guards the rest
