"""Resume tokens (router/frontdoor/resume.py): any replica with the cluster's secret checks
them without shared state; another key, another request, another secret, a tampered or
expired token are refused with distinct errors; "finished" is decided from the request."""

from __future__ import annotations

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from pdserve.router.frontdoor.resume import (
    ResumeTokens,
    check_finished,
    finished_reason,
    load_secret,
)
from pdserve.router.job import Job

SECRET = b"0123456789abcdef-cluster"


def _job(prompt=(5, 6, 7), **params) -> Job:
    params.setdefault("max_tokens", 10)
    return Job(request_id="r1.abcd", token_ids=list(prompt), params=SamplingParams(**params))


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_any_replica_with_the_secret_accepts_it() -> None:
    a, b = ResumeTokens(SECRET), ResumeTokens(SECRET)
    token = a.issue("r1", "team-a", _job())
    b.verify(token, "r1", "team-a", _job(), others=["team-a", "team-b"])  # no error


def test_another_key_is_permission_denied_an_unknown_stream_not_found() -> None:
    tokens = ResumeTokens(SECRET)
    token = tokens.issue("r1", "team-a", _job())
    with pytest.raises(PermissionDeniedError, match="another API key"):
        tokens.verify(token, "r1", "team-b", _job(), others=["team-a", "team-b"])
    with pytest.raises(NotFoundError, match="belongs to request 'r1'"):
        tokens.verify(token, "r2", "team-a", _job(), others=[])
    with pytest.raises(NotFoundError, match="unknown stream"):  # another prompt
        tokens.verify(token, "r1", "team-a", _job(prompt=(5, 6, 8)), others=[])
    with pytest.raises(NotFoundError):  # other sampling
        tokens.verify(token, "r1", "team-a", _job(temperature=0.5), others=[])
    with pytest.raises(NotFoundError):  # another cluster's secret
        ResumeTokens(b"another-secret-of-16+").verify(token, "r1", "team-a", _job(), others=[])
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    with pytest.raises(NotFoundError):
        tokens.verify(forged, "r1", "team-a", _job(), others=["team-b"])


def test_request_ids_with_dots_and_malformed_tokens() -> None:
    tokens = ResumeTokens(SECRET)
    token = tokens.issue("a.b.c", "k", _job())
    tokens.verify(token, "a.b.c", "k", _job(), others=[])
    for bad in ("", "v2.1.r.AAAA", "v1.x.r.AAAA", "v1.1.r.!!!", "x" * 600):
        with pytest.raises(InvalidRequestError, match="resume_token"):
            tokens.verify(bad, "r", "k", _job(), others=[])


def test_expiry() -> None:
    clock = Clock()
    tokens = ResumeTokens(SECRET, ttl_s=60, clock=clock)
    token = tokens.issue("r1", "k", _job())
    clock.t += 59
    tokens.verify(token, "r1", "k", _job(), others=[])
    clock.t += 2
    with pytest.raises(NotFoundError, match="expired"):
        tokens.verify(token, "r1", "k", _job(), others=[])


def test_finished_from_the_request_itself() -> None:
    job = _job(max_tokens=4, stop_token_ids=(99,))
    assert finished_reason(job, [1, 2, 3], [2000], 256) is None
    assert "max_tokens" in finished_reason(job, [1, 2, 3, 4], [2000], 256)
    assert "stop token" in finished_reason(job, [1, 99], [2000], 256)
    assert "end-of-sequence" in finished_reason(job, [2000], [2000], 256)
    assert finished_reason(_job(ignore_eos=True), [2000], [2000], 256) is None
    assert "context length" in finished_reason(job, [1], [2000], 4)
    with pytest.raises(FailedPreconditionError, match="already finished"):
        check_finished("x", "r1")
    check_finished(None, "r1")


def test_secret_sources(tmp_path) -> None:
    f = tmp_path / "s"
    f.write_text("a" * 32 + "\n")
    assert load_secret(str(f), None) == (b"a" * 32, f"file {f}")
    key = tmp_path / "router.key"
    key.write_bytes(b"-----BEGIN PRIVATE KEY----- xyz")
    derived, where = load_secret(None, str(key))
    assert len(derived) == 32 and "derived" in where
    assert load_secret(None, str(key))[0] == derived  # every replica with the key agrees
    assert load_secret(None, None, b"r" * 32)[0] == b"r" * 32
    f.write_text("short")
    with pytest.raises(ValueError, match="16 bytes"):
        load_secret(str(f), None)
    with pytest.raises(ValueError):
        ResumeTokens(b"short")
