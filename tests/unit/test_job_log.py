"""The controller's book of job lines behind `slicewise logs`: the lines tagged with a
job, the newest kept per job for the newest jobs, and followers that get new lines."""

from __future__ import annotations

import asyncio
import logging

from controller.logs import JobLog, log_context


def logger_with(book: JobLog) -> logging.Logger:
    log = logging.getLogger(f"test-job-log-{id(book)}")
    log.handlers[:] = [book]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def texts(book: JobLog, job: str) -> list[str]:
    return [line.split(": ", 1)[1] for _, line in book.lines(job)]


def test_only_lines_tagged_with_the_job_are_its_own():
    book = JobLog()
    log = logger_with(book)
    log.info("nobody's")
    with log_context(job="j1"):
        log.info("first of j1")
    log.info("tagged by hand", extra={"job": "j2"})
    with log_context(job="j1", gang="g1"):
        log.info("second of j1")
    assert texts(book, "j1") == ["first of j1 [job=j1]", "second of j1 [gang=g1 job=j1]"]
    assert texts(book, "j2") == ["tagged by hand [job=j2]"]
    assert book.lines("j3") == []


def test_the_newest_lines_of_the_newest_jobs_are_kept():
    book = JobLog(keep=3, jobs=2)
    log = logger_with(book)
    for n in range(5):
        log.info("line %d", n, extra={"job": "j1"})
    assert texts(book, "j1") == ["line 2 [job=j1]", "line 3 [job=j1]", "line 4 [job=j1]"]
    log.info("x", extra={"job": "j2"})
    log.info("y", extra={"job": "j3"})
    assert book.lines("j1") == [] and texts(book, "j3") == ["y [job=j3]"]


def test_a_follower_gets_the_new_lines_of_its_job_only():
    book = JobLog()
    log = logger_with(book)
    log.info("before", extra={"job": "j1"})

    async def follow():
        with book.following("j1") as queue:
            log.info("other job", extra={"job": "j2"})
            log.info("after", extra={"job": "j1"})
            seq, line = await asyncio.wait_for(queue.get(), timeout=30)
            return seq, line, queue.empty()

    seq, line, empty = asyncio.run(follow())
    assert line.endswith("after [job=j1]") and empty
    assert seq > book.lines("j1")[0][0]  # newer than what a snapshot had sent
