"""Shared pytest configuration. Fixture families live in their own modules, listed here."""

pytest_plugins = ["tests.fixtures_vllm", "tests.fixtures_db", "tests.fixtures_engine"]
