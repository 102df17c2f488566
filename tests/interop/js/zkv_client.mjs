// A zkv client in JavaScript, written from docs/protocol.md alone
// (npm zeromq@6 + @msgpack/msgpack@3).
//
//   node zkv_client.mjs FRONTEND [PULL_ENDPOINT]
//
// FRONTEND is the broker's frontend address (ipc://... or tcp://...).
// PULL_ENDPOINT is where this client binds its result socket (default
// tcp://127.0.0.1:*; the concrete address is read back and sent as reply_to).
// ZKV_TIMEOUT_MS (default 15000) bounds every wait.
//
// It runs the same fixed scenario as the C client and prints one
// machine-checkable line per step (see tests/test_interop.py); any unexpected
// answer prints "FAIL ..." and exits 1.  Both sockets are read by their own
// async loop; every wait has a timer.

import { decode, encode } from "@msgpack/msgpack";
import * as zmq from "zeromq";

const MAX_SAFE = Number.MAX_SAFE_INTEGER; // 2^53 - 1: every zkv integer fits (docs §2)
const TIMEOUT_MS = Number(process.env.ZKV_TIMEOUT_MS || 15000);

function fail(msg) {
  console.log(`FAIL ${msg}`);
  process.exit(1);
}

const [frontend, pullAt = "tcp://127.0.0.1:*"] = process.argv.slice(2);
if (!frontend) {
  console.error("usage: node zkv_client.mjs FRONTEND [PULL_ENDPOINT]");
  process.exit(2);
}

// ---- codec ----------------------------------------------------------------

const isUint = (x) => Number.isSafeInteger(x) && x >= 0 && x <= MAX_SAFE;

// One frame: {v: 1, kind, ...fields}.  Strings encode as msgpack str,
// Uint8Array as bin, integers as msgpack ints (docs §2).
function frame(kind, fields = {}) {
  return encode({ v: 1, kind, ...fields }, { ignoreUndefined: true });
}

// Packed ids: little-endian int32 as a msgpack bin (docs §5).
function packIds(ids) {
  const out = new Uint8Array(4 * ids.length);
  const view = new DataView(out.buffer);
  ids.forEach((id, i) => view.setInt32(4 * i, id, true));
  return out;
}

// A map with v == 1 and a str kind, or null (docs §2).
function parse(buf) {
  let msg;
  try {
    msg = decode(buf);
  } catch {
    return null;
  }
  if (msg === null || typeof msg !== "object" || Array.isArray(msg) || msg instanceof Uint8Array) return null;
  if (msg.v !== 1 || typeof msg.kind !== "string") return null;
  return msg;
}

// ---- state ------------------------------------------------------------------

let gen = 0; // the client's cache generation (docs §7.4)
let nextTask = 1; // task ids: a counter from 1, never reused
let nextReq = 1;
let ignored = 0; // late, stale, duplicate or undecodable messages
const tasks = new Map(); // id -> task
const replies = []; // reply/error frames not yet claimed by a request
const waiters = new Set(); // {check, resolve, reject, timer}

function wake() {
  for (const w of [...waiters]) {
    const value = w.check();
    if (value !== undefined) {
      waiters.delete(w);
      clearTimeout(w.timer);
      w.resolve(value);
    }
  }
}

// Resolve with check()'s first non-undefined value; fail after ms.
function waitFor(check, ms, what) {
  return new Promise((resolve) => {
    const w = { check, resolve };
    w.timer = setTimeout(() => {
      waiters.delete(w);
      fail(`${what} no answer within ${ms} ms`);
    }, ms);
    waiters.add(w);
    wake();
  });
}

// ---- aggregation (docs §7.4) -----------------------------------------------

function closeTask(t, outcome, reason) {
  t.open = false;
  t.outcome = outcome;
  t.reason = reason;
  clearTimeout(t.timer);
}

// The bus is at generation g: if that is newer, a move.  It cancels exactly the
// open tasks that ran at an older generation; a task with no result yet stays
// open, its own results will say (docs §7.4).
function newGeneration(g) {
  if (!(g > gen)) return;
  const reason = `cache generation moved from ${gen} to ${g}`;
  gen = g;
  for (const t of tasks.values()) if (t.open && t.gen !== null && t.gen < g) closeTask(t, "cancelled", reason);
}

function onResult(m) {
  const t = tasks.get(m.task);
  if (!isUint(m.task) || !isUint(m.rank) || !isUint(m.world) || !isUint(m.gen) || !t || !t.open) {
    ignored++; // unknown or already ended: late
    return;
  }
  if (m.gen < t.floor || m.world === 0 || m.rank >= m.world) {
    ignored++; // stale (not of this task's generation) or malformed
    return;
  }
  if (m.gen < gen) {
    // it ran at a generation the bus has left: what it copied is gone
    closeTask(t, "cancelled", `cache generation moved from ${m.gen} to ${gen}`);
    return;
  }
  newGeneration(m.gen); // a newer one: a move, learned from this result
  if (!t.open) return; // an earlier rank's result of this task was older
  if (t.heard.has(m.rank)) {
    ignored++; // duplicate
    return;
  }
  t.gen = m.gen;
  if (t.world === 0) t.world = m.world;
  t.heard.add(m.rank);
  t.bytes += isUint(m.bytes) ? m.bytes : 0;
  if (m.outcome !== "ok" && t.outcome === "ok") {
    t.outcome = m.outcome; // the first failure wins
    t.reason = `rank ${m.rank}: ${m.reason}`;
  }
  if (Array.isArray(m.digests)) t.digests.set(m.rank, m.digests.map((d) => Buffer.from(d).toString("hex")));
  if (t.heard.size === t.world) {
    t.open = false; // every rank answered
    clearTimeout(t.timer);
  }
}

function onOutcome(m) {
  const t = tasks.get(m.task);
  if (!t || !t.open) ignored++;
  else closeTask(t, String(m.outcome), String(m.reason));
  if (isUint(m.gen)) newGeneration(m.gen); // the task's own generation: one the bus reached
}

// ---- sockets ------------------------------------------------------------------

const opts = { linger: 0, maxMessageSize: 64 * 1024 * 1024 };
const pull = new zmq.Pull(opts);
const dealer = new zmq.Dealer(opts);
let closing = false;

await pull.bind(pullAt);
const replyTo = pull.lastEndpoint; // the concrete address, never the wildcard
dealer.connect(frontend);
console.log(`client js reply_to=${replyTo}`);

async function readLoop(sock, handle) {
  try {
    for await (const frames of sock) {
      const m = frames.length === 1 ? parse(frames[0]) : null;
      if (m === null) ignored++;
      else handle(m, frames[0]);
      wake();
    }
  } catch (err) {
    if (!closing) fail(`receive: ${err}`);
  }
}

readLoop(pull, (m) => (m.kind === "result" ? onResult(m) : ignored++));
readLoop(dealer, (m) => {
  if (m.kind === "outcome") onOutcome(m);
  else if (m.kind === "reply" || m.kind === "error") replies.push(m);
  else ignored++;
});

// ---- requests and tasks --------------------------------------------------------

// Wait for the reply to `req`, or (req === null) for an error without req.
function takeReply(req, what) {
  return waitFor(
    () => {
      const i = replies.findIndex((r) => (req === null ? r.req === undefined || r.req === null : r.req === req));
      return i < 0 ? undefined : replies.splice(i, 1)[0];
    },
    TIMEOUT_MS,
    what,
  );
}

async function request(kind, fields = {}) {
  const req = nextReq++;
  const control = ["pause", "clear", "resume"].includes(kind);
  await dealer.send(frame(kind, { req, ...(control ? { timeout_ms: TIMEOUT_MS } : {}), ...fields }));
  const r = await takeReply(req, kind);
  if (r.kind === "error") fail(`${kind} error code=${r.code} reason=${r.reason}`);
  if (r.op !== kind) fail(`${kind} unexpected reply op=${r.op}`);
  return r;
}

async function submit(op, { src, dst, tier, seed, form = "packed" } = {}) {
  const id = nextTask++;
  const t = {
    id,
    open: true,
    floor: gen, // the task cannot have run at an older generation
    gen: null, // its generation: the gen of its results
    world: 0,
    heard: new Set(),
    bytes: 0,
    outcome: "ok",
    reason: "",
    digests: new Map(),
  };
  t.timer = setTimeout(() => {
    if (t.open) closeTask(t, "timeout", "no outcome before the client's deadline");
    wake();
  }, TIMEOUT_MS);
  tasks.set(id, t);
  const ids = (list) => (list === undefined ? undefined : form === "packed" ? packIds(list) : list);
  // Two frames, no identity, no empty delimiter (docs §3.1).
  await dealer.send([frame("submit", { task: id, reply_to: replyTo }), frame("body", { op, src: ids(src), dst: ids(dst), tier, seed })]);
  return id;
}

const waitTask = (id) => waitFor(() => (tasks.get(id).open ? undefined : tasks.get(id)), TIMEOUT_MS + 1000, `task ${id}`);

async function runOk(label, op, args) {
  const t = await waitTask(await submit(op, args));
  if (t.outcome !== "ok") fail(`${label} ${t.outcome} reason=${t.reason}`);
  console.log(`${label} ok bytes=${t.bytes} ranks=${t.world}`);
  return t;
}

// Our own clear: every task submitted before the request is of an older generation (docs §7.4).
function clearedBy(g, before) {
  if (!(g > gen)) return;
  gen = g;
  for (const t of tasks.values()) if (t.open && t.id < before) closeTask(t, "cancelled", "caches were cleared");
}

// ---- the scenario --------------------------------------------------------------

let st = await request("status");
let alive = st.ranks.filter((r) => r.alive === true).length;
if (alive < st.world) {
  st = await request("status", { wait_ranks: st.world, timeout_ms: TIMEOUT_MS });
  alive = st.world;
}
gen = st.gen;
console.log(`status ok state=${st.state} world=${st.world} alive=${alive} gen=${gen}`);

await request("ping");
console.log("ping ok");

const gpuA = [0, 1, 2, 3], cpu = [20, 21, 22, 23], gpuB = [8, 9, 10, 11];
await runOk("fill", "fill", { dst: gpuA, tier: "gpu", seed: 11 });
const before = await runOk("checksum", "checksum", { src: gpuA, tier: "gpu" });
await runOk("swap_out", "swap_out", { src: gpuA, dst: cpu });
await runOk("swap_in", "swap_in", { src: cpu, dst: gpuB, form: "array" }); // the array form of ids
const after = await runOk("checksum_after", "checksum", { src: gpuB, tier: "gpu" });
for (let r = 0; r < st.world; r++) {
  const a = before.digests.get(r), b = after.digests.get(r);
  if (!a || !b || a.length !== 4 || a.join() !== b.join()) fail(`roundtrip digests differ on rank ${r}`);
}
console.log("roundtrip ok identical=true");

// A bad block id: every rank answers failed; the first failure is the outcome.
let t = await waitTask(await submit("swap_out", { src: [0], dst: [999] }));
if (t.outcome !== "failed") fail(`bad_ids expected failed, got ${t.outcome}`);
console.log(`bad_ids failed ranks=${t.world} reason=${t.reason}`);

// pause; a task submitted while paused is queued, then cancelled by clear.
let r = await request("pause");
console.log(`pause ok epoch=${r.epoch} gen=${r.gen} state=${r.state} drain_ms=${Number(r.drain_ms).toFixed(3)}`);

const queued = await submit("swap_out", { src: gpuA, dst: cpu });
const beforeClear = nextTask; // the tasks submitted before the clear request
r = await request("clear");
console.log(`clear ok epoch=${r.epoch} gen=${r.gen} state=${r.state} cancelled=${r.cancelled} freed=${r.freed}`);
t = await waitTask(queued); // the broker's outcome message arrives before the clear reply
console.log(`queued ${t.outcome} reason=${t.reason}`);
clearedBy(r.gen, beforeClear);

t = await waitTask(await submit("swap_out", { src: gpuA, dst: cpu }));
console.log(`while_cleared ${t.outcome}`);

r = await request("resume");
console.log(`resume ok epoch=${r.epoch} gen=${r.gen} state=${r.state}`);
newGeneration(r.gen);

await runOk("after_resume", "swap_out", { src: gpuA, dst: cpu });

// A controller on another connection pauses, clears and resumes.  A task
// queued at the clear ends cancelled; the tasks submitted after the resume ran
// at the new generation, which this connection learns from their results:
// they end ok, none is cancelled (docs §7.4).
const ctl = new zmq.Dealer(opts);
ctl.connect(frontend);
let ctlReq = 1;
async function ctlRequest(kind) {
  await ctl.send(frame(kind, { req: ctlReq++, timeout_ms: TIMEOUT_MS }));
  const timer = setTimeout(() => fail(`controller ${kind} no reply within ${TIMEOUT_MS} ms`), TIMEOUT_MS);
  const [reply] = await ctl.receive();
  clearTimeout(timer);
  const m = parse(reply);
  if (m === null || m.kind !== "reply" || m.op !== kind || !isUint(m.gen)) fail(`controller ${kind}: unexpected answer`);
  return m;
}
await ctlRequest("pause");
const held = await submit("swap_out", { src: gpuA, dst: cpu });
await request("ping"); // one connection keeps order: the task is queued now
await ctlRequest("clear");
t = await waitTask(held);
console.log(`foreign_queued ${t.outcome}`);
const foreignGen = (await ctlRequest("resume")).gen;
ctl.close();
const afterIds = [];
for (let i = 0; i < 5; i++) afterIds.push(await submit("swap_out", { src: gpuA, dst: cpu })); // pipelined
let okAtNew = 0;
for (const id of afterIds) {
  t = await waitTask(id);
  if (t.outcome !== "ok") fail(`foreign_after ${t.outcome} reason=${t.reason}`);
  if (t.gen === foreignGen) okAtNew++;
}
console.log(`foreign_after ok=${okAtNew} gen=${gen} resumed_gen=${foreignGen}`);

// Bad input: not msgpack (an error without req), then a wrong version (an
// error that still echoes the readable req, protocol.md §8.1).
await dealer.send(Buffer.from([0xc1]));
r = await takeReply(null, "malformed");
console.log(`malformed ${r.kind} code=${r.code}`);

const badReq = nextReq++;
await dealer.send(encode({ v: 2, kind: "ping", req: badReq }));
r = await takeReply(badReq, "bad_version");
console.log(`bad_version ${r.kind} code=${r.code} reason=${r.reason}`);

await request("ping"); // the bus still serves after bad input
console.log(`done tasks=${nextTask - 1} ignored=${ignored}`);

closing = true;
dealer.close();
pull.close();
process.exit(0);
