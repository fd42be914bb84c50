"""Every reason code Arbiter gives, and the one table of what an agent should do about each.

A refusal, from whichever core or processor, carries one of these codes; its JSON
diagnostic carries ``WHAT_TO_DO[code]``; the SDK's ``retriable`` reads ``RETRIABLE``.
Codes are part of the wire contract: agents match on them, so a code is never renamed.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """A stable reason code (a ``str``, so it goes on the wire as itself)."""

    # Lease requests
    INVALID_RESOURCE = "invalid_resource"
    INVALID_AGENT = "invalid_agent"
    INVALID_MODE = "invalid_mode"
    INVALID_TTL = "invalid_ttl"
    INVALID_WAIT = "invalid_wait"
    BUSY = "busy"
    ALREADY_HOLDER = "already_holder"
    ALREADY_WAITING = "already_waiting"
    LOCK_ORDER_VIOLATION = "lock_order_violation"
    NOT_WAITING = "not_waiting"
    NOTHING_TO_REVOKE = "nothing_to_revoke"
    WAIT_TIMED_OUT = "wait_timed_out"
    CANCELLED_BY_AGENT = "cancelled_by_agent"
    DEADLOCK_VICTIM = "deadlock_victim"
    # Request ids: one decision per id, ever
    REQUEST_EXPIRED = "request_expired"
    CLOCK_SKEW = "clock_skew"
    REQUEST_ID_TAKEN = "request_id_taken"
    # Fencing: one rule for renew, release and write (``arbiter.streams.cores.fencing``)
    STALE_FENCING_TOKEN = "stale_fencing_token"
    LEASE_NOT_LIVE = "lease_not_live"
    NOT_HOLDER = "not_holder"
    LEASE_NOT_EXCLUSIVE = "lease_not_exclusive"
    # The gateway
    INVALID_INTENT = "invalid_intent"
    INVALID_ARGUMENTS = "invalid_arguments"
    ARGUMENTS_TOO_LARGE = "arguments_too_large"
    NO_POLICY = "no_policy"
    TOKEN_REQUIRED = "token_required"
    BASE_VERSION_REQUIRED = "base_version_required"
    VERSION_CONFLICT = "version_conflict"
    TOOL_FAILED = "tool_failed"
    UNKNOWN_TOOL = "unknown_tool"
    # Repositories (``arbiter.streams.tools.git``): each cause its own code, with advice that can succeed
    UNKNOWN_REPOSITORY = "unknown_repository"
    INVALID_REF = "invalid_ref"
    BRANCH_MISSING = "branch_missing"
    NO_SANDBOX = "no_sandbox"
    SANDBOX_EXISTS = "sandbox_exists"
    NOTHING_TO_MERGE = "nothing_to_merge"
    TARGET_CHECKED_OUT_ELSEWHERE = "target_checked_out_elsewhere"
    TARGET_DIRTY = "target_dirty"
    UNTRACKED_IN_THE_WAY = "untracked_in_the_way"
    CHECK_FAILED = "check_failed"
    CHECK_TIMED_OUT = "check_timed_out"
    CHECK_CHANGED = "check_changed"
    REBASE_CONFLICT = "rebase_conflict"
    NOT_YOUR_MERGE = "not_your_merge"
    REVERT_CONFLICT = "revert_conflict"
    # Dead letters: input a processor could not use
    NOT_SINGLE_OBJECT = "not_single_object"
    TRUNCATED = "truncated"
    UNKNOWN_FINGERPRINT = "unknown_fingerprint"
    MALFORMED_BODY = "malformed_body"
    WRONG_SCHEMA = "wrong_schema"
    INVALID_VALUE = "invalid_value"
    TOO_LARGE = "too_large"
    UNSUPPORTED_COMMAND = "unsupported_command"
    KEY_MISMATCH = "key_mismatch"
    MISROUTED = "misrouted"
    PROCESSOR_FAILED = "processor_failed"
    # The trust boundary (``arbiter.schemas.identity``, ``arbiter.streams.cores.trust``)
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"


_RE_ACQUIRE = "Stop acting on this resource; re-acquire it and re-read its state before you continue."

WHAT_TO_DO: dict[Reason, str] = {
    Reason.INVALID_RESOURCE: "Use a non-empty resource name of at most 256 UTF-8 bytes, e.g. 'ticket:cust_8492'.",
    Reason.INVALID_AGENT: "Send a non-empty agent id.",
    Reason.INVALID_MODE: "Use mode 'exclusive' or 'shared'.",
    Reason.INVALID_TTL: "Use a TTL above zero and within the configured maximum; renew long work instead.",
    Reason.INVALID_WAIT: "Use a wait of zero (try once) or more, within the configured maximum.",
    Reason.BUSY: "The resource is held. Retry later, or send a wait time to queue for it.",
    Reason.ALREADY_HOLDER: "You already hold this resource; keep using that lease and its token.",
    Reason.ALREADY_WAITING: "You already wait for this resource; wait for that request or cancel it.",
    Reason.LOCK_ORDER_VIOLATION: "Release the resources later in the global order first, or acquire in sorted "
                                 "order (client.leases does this).",
    Reason.NOT_WAITING: "There is no queued request with that id for you (it may already have been granted).",
    Reason.NOTHING_TO_REVOKE: "The agent holds and waits for nothing on this resource.",
    Reason.WAIT_TIMED_OUT: "The resource stayed busy. Retry later or wait longer.",
    Reason.CANCELLED_BY_AGENT: "Your request was withdrawn before it was granted.",
    Reason.DEADLOCK_VICTIM: "Abort this subtask: compensate what it did, release what it holds, and retry it later.",
    Reason.REQUEST_EXPIRED: "The command was sent longer ago than the id window, so it is not decided (it may "
                            "have been already). Read the current state and send a new command with a new id.",
    Reason.CLOCK_SKEW: "Your clock is ahead of the broker's by more than the allowed skew. Fix the clock (NTP) "
                       "and send the command again.",
    Reason.REQUEST_ID_TAKEN: "Another agent's command already has this request id on this resource. Use a fresh, "
                             "unique id (a UUID).",
    Reason.STALE_FENCING_TOKEN: "Your lease is gone and someone newer was granted. " + _RE_ACQUIRE,
    Reason.LEASE_NOT_LIVE: "Your lease expired, was released or was revoked. " + _RE_ACQUIRE,
    Reason.NOT_HOLDER: "That token belongs to another agent's lease. Use your own lease's token.",
    Reason.LEASE_NOT_EXCLUSIVE: "Writes need an exclusive lease; a shared lease is for reading.",
    Reason.INVALID_INTENT: "Send a non-empty resource, agent id, intent id and tool name.",
    Reason.INVALID_ARGUMENTS: "Send the tool's arguments as one JSON object.",
    Reason.ARGUMENTS_TOO_LARGE: "Send a smaller change (split it), at most the configured size.",
    Reason.NO_POLICY: "This resource has no write policy; an operator must configure one for its name prefix.",
    Reason.TOKEN_REQUIRED: "Acquire a lease on the resource and send its fencing token with the write.",
    Reason.BASE_VERSION_REQUIRED: "Read the resource (client.snapshot) and send the version your change is "
                                  "based on.",
    Reason.VERSION_CONFLICT: "The resource changed since your base. Apply your intent on top of the changes listed "
                             "(rebase), then send it with the current version as base.",
    Reason.TOOL_FAILED: "The tool ran and failed; nothing was applied. Read the error, fix the arguments, retry "
                        "with a new intent id.",
    Reason.UNKNOWN_TOOL: "Use one of the tools registered in the worker.",
    Reason.UNKNOWN_REPOSITORY: "Use a repository this deployment serves (the operator configures them: ARBITER_REPOS "
                               "or repos.toml, the same for the workers).",
    Reason.INVALID_REF: "Name a branch: letters, digits and ._/- only, not starting with '-' and without '..'.",
    Reason.BRANCH_MISSING: "The branch does not exist in the repository: name one that does (git branch --list).",
    Reason.NO_SANDBOX: "You have no sandbox of this repository (never made, or discarded): make one "
                       "(sandbox_create, arbiter sandbox create), redo or bring your commits there, and merge it.",
    Reason.SANDBOX_EXISTS: "You have a sandbox of this repository already: work in it (its path is in the "
                           "diagnostic), merge it, or discard it first.",
    Reason.NOTHING_TO_MERGE: "Your sandbox branch has no commit the target lacks: commit your work there first.",
    Reason.TARGET_CHECKED_OUT_ELSEWHERE: "The target branch is checked out in another worktree, which would be "
                                         "left behind: the operator switches that worktree to another branch "
                                         "(the command is in the diagnostic); or merge into another target.",
    Reason.TARGET_DIRTY: "The repository's main checkout has uncommitted changes on the target: the operator "
                         "commits or stashes them there (the paths are in the diagnostic); then merge again.",
    Reason.UNTRACKED_IN_THE_WAY: "Files in the main checkout that git does not track sit where your merge adds "
                                 "files: the operator moves them away (the paths are in the diagnostic); then "
                                 "merge again.",
    Reason.CHECK_FAILED: "The repository's check failed on your merge result (its output is in the diagnostic): "
                         "fix it in your sandbox, commit, and merge again.",
    Reason.CHECK_TIMED_OUT: "The repository's check ran past its time limit on your merge result: make it faster "
                            "in your sandbox (or ask the operator for a longer limit), commit, and merge again.",
    Reason.CHECK_CHANGED: "The repository's check is not the one your merge joined the train with (the operator "
                          "changed it, or the check runner reads another configuration than the host): merge again, "
                          "and it joins with the check the repository has now.",
    Reason.REBASE_CONFLICT: "The rebase was undone, your sandbox is as it was: merge the target into your sandbox "
                            "(git fetch origin main && git merge origin/main), resolve the paths listed, commit, and "
                            "merge again.",
    Reason.NOT_YOUR_MERGE: "Only the saga of the agent that merged can revert a merge (as its compensation); an "
                           "operator reverts one by aborting that saga, or by hand with git revert.",
    Reason.REVERT_CONFLICT: "What landed since the merge conflicts with undoing it: a person must revert it by "
                            "hand (git revert -m 1 <merge>) and resolve the paths listed.",
    Reason.NOT_SINGLE_OBJECT: "Encode the message as Avro single-object encoding (0xC3 0x01, fingerprint, body).",
    Reason.TRUNCATED: "Send the whole message.",
    Reason.UNKNOWN_FINGERPRINT: "Encode with a schema this Arbiter knows (the .avsc files it ships).",
    Reason.MALFORMED_BODY: "Encode the body with the schema its fingerprint names.",
    Reason.WRONG_SCHEMA: "Send a record of a type this topic carries.",
    Reason.INVALID_VALUE: "Send values the schema's rules allow.",
    Reason.TOO_LARGE: "Send a smaller message, within the configured maximum.",
    Reason.UNSUPPORTED_COMMAND: "Send this record to the topic that carries it.",
    Reason.KEY_MISMATCH: "Key the message by the id it names (the resource, the saga), as the SDK does.",
    Reason.MISROUTED: "Produce the message to the partition its key hashes to under Kafka's default partitioner "
                      "(murmur2 of the key bytes, as Kafka's Java client): do not choose a partition yourself. This "
                      "copy was not decided; a copy on the right partition is decided there.",
    Reason.PROCESSOR_FAILED: "A processor failed on this message (a bug in Arbiter, not in your request): it was "
                             "quarantined with nothing applied. Report it; send a corrected request with a new id.",
    Reason.UNAUTHENTICATED: "The command is unsigned, its signature does not verify, or its key is unknown, rotated "
                            "or revoked. Sign with your current key (arbiter agents add/rotate issues one).",
    Reason.FORBIDDEN: "Your identity may not do this: act as another agent, touch a resource outside your allowed "
                      "prefixes, send a command only workers or an admin may send, or use an id reserved for sagas.",
}

OUT_OF_WINDOW: frozenset[str] = frozenset({Reason.REQUEST_EXPIRED.value, Reason.CLOCK_SKEW.value})
"""Refusals for the command's send time alone (at or below the floor of forgotten ids, or too far ahead):
they answer that command and decide nothing, so they are not an outcome of its id."""

RETRIABLE: frozenset[Reason] = frozenset({
    Reason.BUSY, Reason.WAIT_TIMED_OUT, Reason.CANCELLED_BY_AGENT, Reason.DEADLOCK_VICTIM,
})
"""Refusals after which the same request may succeed later, unchanged."""


def what_to_do(reason: str) -> str:
    """What an agent should do about ``reason`` (any string: unknown codes get a generic answer)."""
    try:
        return WHAT_TO_DO[Reason(reason)]
    except ValueError:
        return "Fix the request and send it again."


def is_retriable(reason: str) -> bool:
    """Whether the same request may succeed later (``ArbiterError.retriable``)."""
    return reason in RETRIABLE
