"""Whole-federation checkpoints under FederatedScope (standalone and distributed), in the
embedded runner's files (`fs_plugins.run.checkpoint`), each party writing its own.

At the end of a due round t (after its evaluation content went out) the server snapshots its
state and sends CHECKPOINT_MSG to every client; each client writes `client_<id>.round<t>`
and answers CHECKPOINTED_MSG; once all have answered (their round-t metrics are in by then:
a client answers in order) the server writes `server.round<t>`, which marks round t
complete, and removes older rounds' files. Over gRPC each process has its own random
generators, so each party's file holds its own.

Resuming (`fsplug.checkpoint.resume_from`): the server restores its file of the newest
complete round t and starts at round t+1; a client restores its newest file before the round
its first message is about: the federation's round t when the whole federation restarts, the
round in progress when one client process was restarted and rejoins (the server resends it
that round's content).
"""
from __future__ import annotations

import logging

from fs_plugins.run.checkpoint import (
    CheckpointError,
    check_resumable,
    checkpointed_rounds,
    client_party,
    client_payload,
    pack,
    party_info,
    party_path,
    prune,
    read_info,
    read_party,
    restore_client,
    server_payload,
    set_rng_state,
    should_checkpoint,
    write_packed,
)

logger = logging.getLogger(__name__)

CHECKPOINT_MSG = 'fsplug_checkpoint'        # server -> client: write your file of round t
CHECKPOINTED_MSG = 'fsplug_checkpointed'    # client -> server: written


class ServerCheckpoints:
    """The server's side: a snapshot per round asked for, written once every client answered."""

    def __init__(self, cfg, procedure, run_dir: str, resumed_round: int = -1):
        self.cfg, self.procedure, self.run_dir = cfg, procedure, run_dir
        self.last_round = resumed_round      # newest round asked for (or resumed from)
        self.pending: dict[int, tuple] = {}  # round -> (skeleton, tensors, clients waited for)

    def due(self, rounds_done: int) -> bool:
        return should_checkpoint(self.cfg, rounds_done) and rounds_done - 1 > self.last_round

    def begin(self, round_idx: int, client_ids) -> None:
        self.last_round = round_idx
        tensors: dict = {}
        skeleton = pack(server_payload(self.procedure), tensors, 'server')
        self.pending[round_idx] = (skeleton, tensors, set(int(c) for c in client_ids))

    def abandon_waiting_for(self, client_id: int) -> None:
        """A client process restarted: its state of a pending round is lost, so that round's
        checkpoint is abandoned (the previous complete one stays)."""
        for round_idx in [r for r, (_, _, waiting) in self.pending.items() if client_id in waiting]:
            del self.pending[round_idx]
            logger.warning(f'fsplug: checkpoint of round {round_idx} abandoned: client '
                           f'{client_id} restarted before writing it')

    def answered(self, round_idx: int, client_id: int) -> bool:
        """Records a client's answer; True once round `round_idx` is complete on disk."""
        if round_idx not in self.pending:
            logger.warning(f'fsplug: checkpoint answer of client {client_id} for round '
                           f'{round_idx}, which was not asked for; ignored')
            return False
        skeleton, tensors, waiting = self.pending[round_idx]
        waiting.discard(int(client_id))
        if waiting:
            return False
        del self.pending[round_idx]
        info = party_info(self.cfg, round_idx, len(self.procedure.results.rows))
        size = write_packed(party_path(self.run_dir, 'server', round_idx), skeleton, tensors, info)
        prune(self.run_dir, round_idx)
        logger.info(f'fs-plugins: checkpoint of round {round_idx} complete in '
                    f'{self.run_dir}/checkpoint (server file {size} bytes)')
        return True


def resume_client(run_dir: str, procedure, before_round: int, with_rng: bool) -> int:
    """Restores client `procedure` from its newest file of a round before `before_round`;
    returns that round."""
    party = client_party(procedure.client_id)
    rounds = [r for r in checkpointed_rounds(run_dir, party) if r < before_round]
    if not rounds:
        raise CheckpointError(f'checkpoint: {run_dir}/checkpoint has no file of {party} before '
                              f'round {before_round}')
    path = party_path(run_dir, party, rounds[-1])
    check_resumable(procedure.cfg, read_info(path).get('config', {}))
    payload = read_party(path, client_payload(procedure))
    restore_client(procedure, payload)
    if with_rng and 'rng' in payload:
        set_rng_state(payload['rng'])
    if rounds[-1] < before_round - 1:
        logger.warning(f'fsplug: {party} resumes from its checkpoint of round {rounds[-1]}, '
                       f'older than round {before_round - 1} (fsplug.checkpoint.freq > 1)')
    return rounds[-1]
