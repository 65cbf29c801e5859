"""What the processes of one router share: the fleet-state log and its transports.

:mod:`router.fleet.log` holds the records and the fold every process runs alike;
:mod:`router.fleet.ring` carries the log between the workers of one host, and
:mod:`router.fleet.stream` between replicas, through one Redis Stream per fleet.
"""
