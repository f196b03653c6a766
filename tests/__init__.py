"""Tests in three tiers: unit (pure logic), sockets (services in-process on loopback), integration (real processes)."""
