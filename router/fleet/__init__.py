"""The backends and what the router's processes know of them: health (``backends``), load
(``load``), their gauges, and the fleet-state log every process shares (``log``, ``ring``,
``stream``, ``process``)."""
