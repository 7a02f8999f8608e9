"""What an answer's Retry-After asks for (pure code: no Redis, no I/O)."""

from __future__ import annotations

import pytest
from scrapy.http import Response

from scrapy_redislock.requests.outcomes import retry_after


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30", 30.0),
        (" 7 ", 7.0),
        (b"\xb2", None),  # "²" in latin-1: str.isdigit() takes it, float() does not
        ("-5", None),
        ("nan", None),
        ("inf", None),
        ("0x10", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date past
    ],
)
def test_a_retry_after_is_a_number_of_seconds_or_a_date_else_none(
    value: str | bytes, seconds: float | None
) -> None:
    response = Response("http://example.com", status=429, headers={"Retry-After": value})
    assert retry_after(response) == seconds


def test_a_retry_after_date_is_read_against_the_answers_own_date() -> None:
    response = Response(
        "http://example.com",
        status=503,
        headers={
            "Retry-After": "Wed, 21 Oct 2015 07:28:30 GMT",
            "Date": "Wed, 21 Oct 2015 07:28:00 GMT",
        },
    )
    assert retry_after(response) == 30.0
