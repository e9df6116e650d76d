"""What every role speaks: the records that cross a role boundary (:mod:`.records`) and the
roles' ``typing.Protocol`` classes (:mod:`.protocols`). Imports nothing of oppo's but
:mod:`oppo.scoring.streaming`'s output record."""
