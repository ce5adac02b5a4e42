"""Engine replicas: several engines behind one client. ``remote_engine`` is the client the
services call, ``engine_replica`` the engine each replica runs, ``router`` picks the replica,
by ``prefix_affinity`` (who has served this cached prefix) with a least-loaded fallback."""
