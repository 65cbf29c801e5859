"""Tools that prove routing helps: fleet simulator, workloads, replay, Locust, bench."""
