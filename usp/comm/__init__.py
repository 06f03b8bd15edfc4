"""The two communication mechanisms of usp, with byte and time accounting.

- ``all_to_all``: the ulysses seq <-> head exchange (``all_to_all`` / ``post_all_to_all``),
  blocking or in flight (``InFlight``) while the caller computes, in fragments where asked.
- ``p2p``: the ring's transport (``RingComm``), send to the next ring rank and receive from
  the previous one via ``batch_isend_irecv`` on the ring's own group.
- ``stats``: ``CommStats``, the bytes this rank *sends to other ranks*, per axis, and the
  seconds it spent blocked (``exposed_s``), so tests can assert volumes and the trainer
  can report the share of time in communication; an all-to-all left in flight also
  records how long it travelled while the caller computed (``hidden_s``).
- ``wire``: how a tensor reaches the wire (``on_wire``: a CPU copy when gloo must carry a
  CUDA tensor) and what a failed or mismatched collective says (``naming_collectives``,
  ``check_agreement``).
"""

from .all_to_all import (GLOO_FRAGMENT_BYTES, InFlight, all_to_all, all_to_all_start,
                         fragment_count, post_all_to_all)
from .p2p import RingComm
from .stats import CommStats, clock_for
from .wire import (PEER_LOST, check_agreement, collective_error, naming_collectives, on_wire,
                   stage_through_host)

__all__ = ["GLOO_FRAGMENT_BYTES", "PEER_LOST", "CommStats", "InFlight", "RingComm", "all_to_all",
           "all_to_all_start", "check_agreement", "clock_for", "collective_error",
           "fragment_count", "naming_collectives", "on_wire", "post_all_to_all",
           "stage_through_host"]
