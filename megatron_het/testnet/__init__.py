"""Test networks on one machine: a namespace per node of a cluster file, shaped by tc
(:mod:`megatron_het.testnet.topology` plans it, :mod:`megatron_het.testnet.netns` builds it;
``tools/testnet.py`` is the command)."""
