"""test_suite.py's stand-in for a test that leaves a sticky fault (run by name: no test_ prefix,
so the suite never collects it): a failure naming CUDA_ERROR_ASSERT, then a test that would run
after it in the same worker."""


def test_a_plain_failure_first():
    assert 1 + 1 == 3


def test_then_a_sticky_fault():
    raise RuntimeError("cuStreamSynchronize failed: CUDA_ERROR_ASSERT: device-side assert triggered")


def test_then_one_the_faulted_context_would_fail():
    pass
