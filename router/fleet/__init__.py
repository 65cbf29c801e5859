"""What a router's processes share: the fleet-state log (:mod:`router.fleet.log`) and its transports."""
