"""Tests for the RoleMesh Node Agent.

Unit tests use fakes (``task.Clock``, ``MemoryReactor``, ``StubTreq``);
integration tests (``tests.integration``) start a real llama-server.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "rolemesh",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("rolemesh")
