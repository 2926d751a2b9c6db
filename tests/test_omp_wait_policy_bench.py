"""bench.omp_wait_policy's child processes: each gets the policy it names, whatever this process has."""

from bench.omp_wait_policy import child_environment


def test_the_default_case_unsets_the_policy_and_the_passive_case_sets_it():
    base = {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}  # as the test process and workers have it
    assert child_environment("default", base) == {"PATH": "/bin"}
    assert child_environment("passive", {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert base == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}  # not modified

