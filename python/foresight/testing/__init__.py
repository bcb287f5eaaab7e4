"""Test beds: what the test suite, the benches, the examples and ``foresight demo`` start or compare against.

Users' code paths never import this package (tests/test_layers.py checks that only the CLI and the demo do);
it ships inside the package so that benches and examples run from an installed foresight.

* :mod:`.processes`: free loopback ports, bounded process stops (the one helper of each for the project).
* :mod:`.tether` (:func:`start_tethered`): the one launcher of a bed's server process: it dies with the process
  that started it (a SIGKILLed pytest or bench leaves no ``weed``, etcd or node behind).
* :mod:`.etcd` (:class:`EtcdProcess`): the one etcd launcher (Debian ``etcd-server``).
* :mod:`.sites` (:class:`SiteProcess`): a replication site's storage node as a process.
* :mod:`.wan` (:class:`WanLink`): the WAN bed's delaying, rate-limited link (docs/wan_bed.md).
* :mod:`.seaweed` (:class:`SeaweedServer`): a loopback S3 server (SeaweedFS ``weed mini``).
* :mod:`.http_faults` (:class:`FaultProxy`): an HTTP proxy in front of it answering chosen requests 503/500 or late.
* :mod:`.media_synth`: synthetic videos, images and audio with known content.
* :mod:`.media_reference`: the decode truth (PyAV only, no code of ``foresight.media.video``).
* :mod:`.plan_reference`: the numpy oracle for plan construction.

Example::

    from foresight.testing.etcd import EtcdProcess
    with EtcdProcess("/tmp/etcd") as etcd:
        print(etcd.endpoint)
"""
