"""The machinery of zkv's own test runs, apart from the public test doubles:
rank workers forked from one process that imported torch (``zygote``), and
many hosts on one machine in network namespaces with a Curve bus across them
(``netns``, ``netns_bus``)."""
