//! Multi-process jobs: the torchrun-style environment, a TCP rendezvous through which rank 0
//! hands every other rank a payload (the NCCL unique id), and a liveness channel over the same
//! connections so that a rank that dies or fails is known to every other rank at once.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT` (or the address the job is told to bind) through
//! a [`Gate`]: every connection must open with a hello (see `handshake`) giving the job token,
//! the rank and the world size. Strangers are closed and logged at debug level; a hello from
//! another job, a taken rank or another world size is refused with the reason, which the
//! newcomer reports as its error; the job goes on. Rank 0 answers an accepted rank, once all
//! are there, with `K`, `[len u32, payload]`, `[len u32, table]` (every rank's mesh listener
//! `ip:port`, comma separated, rank 0's ip empty: it is `MASTER_ADDR`) and `[len u32, job
//! token]` (the launcher's, or one rank 0 drew). It keeps refusing newcomers until it exits.
//!
//! Afterwards messages of one kind byte: `A` + `[len u32, reason]` (abort), `B` (clean exit),
//! `M` + `[key u64, size u32]` (this rank has reached meeting `key` of `size` ranks; sent to
//! rank 0) and `G` + `[key u64]` (everyone has; rank 0 to each member), and `H` (a heartbeat,
//! every [`HEARTBEAT`]). Rank 0 forwards an abort to every rank. A connection that closes
//! without `B` means its process is gone; one that stays open but silent (no heartbeat) means
//! its process is stopped or cannot be scheduled, which [`Rendezvous::silent_peers`] names.

use super::handshake::{self, read_answer, read_blob_by, refuse, write_blob, Channel, Gate, Hello};
use super::job::JobId;
use super::Failure;
use crate::error::{MoeError, Result};
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Where this process sits in a job started by a torchrun-style launcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`: this process's rank in the world.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: the GPU of this host that this process uses.
    pub local_rank: usize,
    /// `MASTER_ADDR`: host of rank 0.
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on.
    pub master_port: u16,
    /// `MOEFLOW_JOB`: the job token every rank presents (none: rank 0 draws one, and any
    /// process started without a token may join).
    pub job: Option<JobId>,
    /// `MOEFLOW_BIND`: the address this rank's listeners bind to. Without it rank 0 binds
    /// `MASTER_ADDR` and every other rank the address it reaches rank 0 from, never every
    /// interface unless told `0.0.0.0`.
    pub bind: Option<IpAddr>,
}

impl LaunchEnv {
    /// Rank `rank` of a job of `world_size` ranks on this host (rank 0 at 127.0.0.1:`port`),
    /// without a job token or bind address.
    pub fn local(rank: usize, world_size: usize, port: u16) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            job: None,
            bind: None,
        }
    }

    /// Reads the launcher variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `MOEFLOW_JOB`, `MOEFLOW_BIND`) through `get`; `None` when `RANK` and
    /// `WORLD_SIZE` are both unset, an error naming the variable when one is missing or
    /// malformed.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        if get("RANK").is_none() && get("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let num = |name: &str, default: Option<usize>| -> Result<usize> {
            match (get(name), default) {
                (Some(v), _) => v
                    .trim()
                    .parse()
                    .map_err(|_| MoeError::Config(format!("environment variable {name}={v:?} is not a number"))),
                (None, Some(d)) => Ok(d),
                (None, None) => Err(MoeError::Config(format!("environment variable {name} is not set"))),
            }
        };
        let rank = num("RANK", None)?;
        let world_size = num("WORLD_SIZE", None)?;
        let local_rank = num("LOCAL_RANK", Some(rank))?;
        let master_port = num("MASTER_PORT", Some(29_500))?;
        if world_size == 0 || rank >= world_size {
            return Err(MoeError::Config(format!("RANK={rank} must be below WORLD_SIZE={world_size}")));
        }
        let master_port = u16::try_from(master_port)
            .map_err(|_| MoeError::Config(format!("MASTER_PORT={master_port} is not a port")))?;
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let job = get("MOEFLOW_JOB")
            .map(|j| {
                JobId::new(j.trim()).map_err(|e| match e {
                    MoeError::Config(why) => MoeError::Config(format!("MOEFLOW_JOB: {why}")),
                    other => other,
                })
            })
            .transpose()?;
        let bind = get("MOEFLOW_BIND")
            .map(|b| b.trim().parse().map_err(|_| MoeError::Config(format!("MOEFLOW_BIND={b:?} is not an IP address"))))
            .transpose()?;
        Ok(Some(LaunchEnv { rank, world_size, local_rank, master_addr, master_port, job, bind }))
    }
}

fn io_err(rank: usize, what: &str, e: impl std::fmt::Display) -> MoeError {
    MoeError::Comm { rank, op: "rendezvous".into(), message: format!("{what}: {e}") }
}

/// The open connections of a job after the rendezvous; dropping it tells the peers this rank
/// exited cleanly.
pub struct Rendezvous {
    rank: usize,
    job: JobId,
    /// Write halves: rank 0 holds one per other rank (index = rank - 1), others hold rank 0's.
    peers: Arc<Vec<Mutex<TcpStream>>>,
    failure: Failure,
    /// Set while this rank shuts down, so that its own closing sockets are not taken as a
    /// peer's death (and rank 0 stops answering newcomers).
    closing: Arc<AtomicBool>,
    meetings: Arc<Meetings>,
    /// When each peer (indexed as `peers`) was last heard from.
    heard: Arc<Vec<Mutex<Instant>>>,
}

/// How often every rank tells its peers it is alive.
pub const HEARTBEAT: Duration = Duration::from_millis(500);

/// The meetings of a job (see [`Rendezvous::meet`]).
#[derive(Default)]
struct Meetings {
    /// Meetings everyone has reached that a rank here has not yet left.
    done: Mutex<HashSet<u64>>,
    news: Condvar,
    /// Rank 0: the ranks that reached each meeting still gathering.
    arrived: Mutex<HashMap<u64, Vec<usize>>>,
    /// Other ranks: rank 0, which keeps every meeting's count, has left the job.
    host_left: AtomicBool,
}

/// What a rank takes from the rendezvous.
pub(crate) struct Joined {
    /// The bytes rank 0's payload function returned.
    pub payload: Vec<u8>,
    /// Every rank's mesh listener, `host:port`, indexed by rank (port 0: none).
    pub addrs: Vec<String>,
    /// This rank's mesh listener, when asked for, bound where the rendezvous says (see
    /// [`LaunchEnv::bind`]).
    pub listener: Option<TcpListener>,
    /// The connections to the other ranks.
    pub rendezvous: Rendezvous,
}

impl Rendezvous {
    /// Joins the job described by `env`. Rank 0 listens on `MASTER_PORT`, waits for every
    /// other rank and sends each the bytes `payload` returns; the others connect (retrying
    /// until `timeout`) and receive them. Returns the payload and the connections.
    pub fn join(
        env: &LaunchEnv,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(Vec<u8>, Rendezvous)> {
        let joined = Self::join_inner(env, payload, false, timeout)?;
        Ok((joined.payload, joined.rendezvous))
    }

    /// [`Rendezvous::join`] without a payload that also opens this rank's mesh listener
    /// (always present in the result) and tells every rank where every other rank's is.
    pub(crate) fn join_listening(env: &LaunchEnv, timeout: Duration) -> Result<Joined> {
        Self::join_inner(env, || Ok(Vec::new()), true, timeout)
    }

    fn join_inner(
        env: &LaunchEnv,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        listen: bool,
        timeout: Duration,
    ) -> Result<Joined> {
        let deadline = Instant::now() + timeout;
        if env.rank == 0 {
            host(env, payload, listen, deadline)
        } else {
            guest(env, listen, deadline)
        }
    }

    /// The job's token (the launcher's, or the one rank 0 drew).
    pub fn job(&self) -> &JobId {
        &self.job
    }

    /// Starts one reader thread per connection that records aborts and lost peers in the
    /// failure flag (rank 0 also forwards them to every other rank) and handles meetings.
    fn watch(rank: usize, job: JobId, conns: Vec<TcpStream>) -> Result<Rendezvous> {
        let failure = Failure::default();
        let mut readers = Vec::new();
        for s in &conns {
            s.set_read_timeout(None).map_err(|e| io_err(rank, "socket", e))?;
            readers.push(s.try_clone().map_err(|e| io_err(rank, "socket", e))?);
        }
        let peers = Arc::new(conns.into_iter().map(Mutex::new).collect::<Vec<_>>());
        let closing = Arc::new(AtomicBool::new(false));
        let meetings = Arc::new(Meetings::default());
        let heard = Arc::new((0..peers.len()).map(|_| Mutex::new(Instant::now())).collect::<Vec<_>>());
        for (i, mut reader) in readers.into_iter().enumerate() {
            let peer = if rank == 0 { i + 1 } else { 0 };
            let (failure, peers, closing, meetings, heard) =
                (failure.clone(), peers.clone(), closing.clone(), meetings.clone(), heard.clone());
            std::thread::spawn(move || {
                let reason = loop {
                    let message = read_message(&mut reader);
                    *heard[i].lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                    match message {
                        Ok(Message::Heartbeat) => {}
                        Ok(Message::Bye) => {
                            if peer == 0 {
                                meetings.host_left();
                            }
                            return;
                        }
                        Ok(Message::Abort(reason)) => break reason,
                        Ok(Message::Arrived { key, size }) => meetings.arrive(&peers, key, size, peer),
                        Ok(Message::AllArrived(key)) => meetings.finish(key),
                        Err(_) => break format!("rank {peer} exited or lost its connection"),
                    }
                };
                if peer == 0 {
                    meetings.host_left();
                }
                if closing.load(Ordering::SeqCst) {
                    return;
                }
                failure.set(&reason);
                if rank == 0 {
                    broadcast_abort(&peers, &reason, Some(i));
                }
            });
        }
        let (beating, alive) = (peers.clone(), closing.clone());
        std::thread::spawn(move || {
            while !alive.load(Ordering::SeqCst) {
                for p in beating.iter() {
                    let _ = p.lock().unwrap_or_else(|e| e.into_inner()).write_all(b"H");
                }
                std::thread::sleep(HEARTBEAT);
            }
        });
        Ok(Rendezvous { rank, job, peers, failure, closing, meetings, heard })
    }

    /// The peers this rank has not heard from (not even a heartbeat) for longer than
    /// `longer_than`, with how long: rank 0 sees every rank, the others rank 0.
    pub fn silent_peers(&self, longer_than: Duration) -> Vec<(usize, Duration)> {
        self.heard
            .iter()
            .enumerate()
            .map(|(i, at)| {
                let peer = if self.rank == 0 { i + 1 } else { 0 };
                (peer, at.lock().unwrap_or_else(|e| e.into_inner()).elapsed())
            })
            .filter(|&(_, silent)| silent > longer_than)
            .collect()
    }

    /// Waits until all `size` ranks that meet at `key` (a number they agree on, used once)
    /// have called this, the job fails (`give_up()` turns true) or `deadline` passes; says
    /// whether all arrived. Rank 0 keeps the count, though it need not be a member: once it
    /// has left the job, meetings end at once, unmet.
    pub fn meet(&self, key: u64, size: usize, deadline: Instant, give_up: impl Fn() -> bool) -> bool {
        if size <= 1 {
            return true;
        }
        if self.rank == 0 {
            self.meetings.arrive(&self.peers, key, size, 0);
        } else {
            let mut s = self.peers[0].lock().unwrap_or_else(|e| e.into_inner());
            let sent = s
                .write_all(b"M")
                .and_then(|_| s.write_all(&key.to_le_bytes()))
                .and_then(|_| s.write_all(&(size as u32).to_le_bytes()));
            if sent.is_err() {
                return false;
            }
        }
        let ended = || give_up() || self.meetings.host_left.load(Ordering::SeqCst);
        super::meeting::wait_until(&self.meetings.done, &self.meetings.news, deadline, ended, |done| done.remove(&key))
    }

    /// The flag the peers' failures are recorded in.
    pub fn failure(&self) -> Failure {
        self.failure.clone()
    }

    /// Tells every rank that this job failed with `reason`.
    pub fn abort(&self, reason: &str) {
        self.failure.set(reason);
        broadcast_abort(&self.peers, reason, None);
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        for p in self.peers.iter() {
            let mut s = p.lock().unwrap_or_else(|e| e.into_inner());
            let _ = s.write_all(b"B");
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// How often rank 0 looks at the ranks that joined, to forget those that left.
const LOOK: Duration = Duration::from_millis(50);

/// Rank 0's side of the rendezvous (see [`Rendezvous::join`]).
fn host(env: &LaunchEnv, payload: impl FnOnce() -> Result<Vec<u8>>, listen: bool, deadline: Instant) -> Result<Joined> {
    let (world, port) = (env.world_size, env.master_port);
    let bound = match env.bind {
        Some(ip) => TcpListener::bind((ip, port)),
        None => TcpListener::bind((env.master_addr.as_str(), port)),
    };
    let at = env.bind.map_or_else(|| env.master_addr.clone(), |ip| ip.to_string());
    let listener = bound.map_err(|e| io_err(0, &format!("listening on {at}:{port}"), e))?;
    let ip = listener.local_addr().map_err(|e| io_err(0, "listener", e))?.ip();
    let mesh = listen.then(|| TcpListener::bind((ip, 0))).transpose().map_err(|e| io_err(0, "mesh listener", e))?;
    let mesh_port =
        mesh.as_ref().map(|l| l.local_addr().map(|a| a.port())).transpose().map_err(|e| io_err(0, "mesh", e))?;
    log::debug!("rank 0: rendezvous of {world} ranks listening on {at}:{port}");
    if let Some(mesh_port) = mesh_port {
        log::debug!("rank 0: mesh listening on {ip}:{mesh_port}");
    }
    let gate = Gate::open(listener, format!("rank 0 rendezvous port {port}")).map_err(|e| io_err(0, "listener", e))?;
    // Joined ranks by rank (0 unused): the connection and where its mesh listener is.
    let mut joined: Vec<Option<(TcpStream, String)>> = (0..world).map(|_| None).collect();
    // Refusals and departures, reported if the rendezvous fails.
    let mut notes: Vec<String> = Vec::new();
    loop {
        for (r, slot) in joined.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|(s, _)| gone(s)) {
                log::debug!("rank 0: rank {r} left before the rendezvous completed");
                notes.push(format!("rank {r} joined and then left"));
                *slot = None;
            }
        }
        if joined.iter().skip(1).all(Option::is_some) {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..world).filter(|&r| joined[r].is_none()).collect();
            let mut why = format!("ranks {missing:?} never joined");
            if !notes.is_empty() {
                why += &format!(" ({})", notes.join("; "));
            }
            for (s, _) in joined.into_iter().flatten() {
                refuse(s, &format!("rank 0 timed out waiting for the others: {why}"));
            }
            return Err(io_err(0, "timed out", why));
        }
        let Some(a) = gate.next(deadline.min(Instant::now() + LOOK)) else { continue };
        let h = &a.hello;
        match h.mismatch(Channel::Rendezvous, env.job.as_ref(), world, 1..world, |r| joined[r].is_some()) {
            Some(reason) => {
                log::debug!("rank 0: refused {} (rank {} of {}): {reason}", a.from, h.rank, h.world);
                notes.push(format!("refused rank {} from {}: {reason}", h.rank, a.from));
                refuse(a.stream, &reason);
            }
            None => {
                log::debug!("rank 0: rank {} joined from {}", h.rank, a.from);
                let mesh_at = SocketAddr::new(h.listen_ip.unwrap_or(a.from.ip()), h.port).to_string();
                joined[h.rank] = Some((a.stream, mesh_at));
            }
        }
    }
    let data = match payload() {
        Ok(d) => d,
        Err(e) => {
            for (s, _) in joined.into_iter().flatten() {
                refuse(s, &format!("rank 0 failed: {e}"));
            }
            return Err(e);
        }
    };
    let job = env.job.clone().unwrap_or_else(JobId::random);
    let mut table = vec![format!(":{}", mesh_port.unwrap_or(0))];
    table.extend(joined.iter().skip(1).flatten().map(|(_, at)| at.clone()));
    let listing = table.join(",");
    let mut conns = Vec::with_capacity(world - 1);
    let mut lost = None;
    for (r, (mut s, _)) in joined.into_iter().enumerate().skip(1).filter_map(|(r, j)| j.map(|j| (r, j))) {
        let sent = handshake::accept(&mut s)
            .and_then(|_| write_blob(&mut s, &data))
            .and_then(|_| write_blob(&mut s, listing.as_bytes()))
            .and_then(|_| write_blob(&mut s, job.as_str().as_bytes()));
        if let Err(e) = sent {
            lost.get_or_insert(format!("rank {r} was lost as the rendezvous completed: {e}"));
        }
        conns.push(s);
    }
    let me = Rendezvous::watch(0, job, conns)?;
    if let Some(reason) = lost {
        me.abort(&reason);
        return Err(io_err(0, "completing", reason));
    }
    turn_away_newcomers(gate, env.job.clone(), world, me.closing.clone());
    log::debug!("rank 0: all {world} ranks joined job {}", me.job);
    Ok(Joined { payload: data, addrs: resolve(&listing, &env.master_addr), listener: mesh, rendezvous: me })
}

/// Whether the peer of `s`, which has nothing to say yet, closed its end.
fn gone(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    let closed = s.set_nonblocking(true).is_ok()
        && match s.peek(&mut b) {
            Ok(n) => n == 0,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        };
    let _ = s.set_nonblocking(false);
    closed
}

/// Rank 0, once every rank joined: answers every later hello with why it cannot join (a taken
/// rank, another job, another world size) until this rank shuts down (`closing`).
fn turn_away_newcomers(gate: Gate, job: Option<JobId>, world: usize, closing: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        while !closing.load(Ordering::SeqCst) {
            if let Some(a) = gate.next(Instant::now() + LOOK) {
                let reason = a
                    .hello
                    .mismatch(Channel::Rendezvous, job.as_ref(), world, 1..world, |_| true)
                    .unwrap_or_else(|| "the job is complete".into());
                log::debug!("rank 0: refused {} (rank {}): {reason}", a.from, a.hello.rank);
                refuse(a.stream, &format!("{reason} (all {world} ranks of this job are running)"));
            }
        }
    });
}

/// The side of the rendezvous of every rank but 0 (see [`Rendezvous::join`]).
fn guest(env: &LaunchEnv, listen: bool, deadline: Instant) -> Result<Joined> {
    let rank = env.rank;
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    let mut s = loop {
        match TcpStream::connect(&addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(io_err(rank, &format!("connecting to rank 0 at {addr}"), e))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let ip = match env.bind {
        Some(ip) => ip,
        None => s.local_addr().map_err(|e| io_err(rank, "socket", e))?.ip(),
    };
    let mesh = listen
        .then(|| TcpListener::bind((ip, 0)))
        .transpose()
        .map_err(|e| io_err(rank, &format!("listening on {ip}"), e))?;
    let port =
        mesh.as_ref().map(|l| l.local_addr().map(|a| a.port())).transpose().map_err(|e| io_err(rank, "mesh", e))?;
    if let Some(port) = port {
        log::debug!("rank {rank}: mesh listening on {ip}:{port}");
    }
    let hello = Hello {
        channel: Channel::Rendezvous,
        rank,
        world: env.world_size,
        port: port.unwrap_or(0),
        job: env.job.clone(),
        listen_ip: env.bind.filter(|ip| !ip.is_unspecified()),
    };
    hello.write(&mut s).map_err(|e| io_err(rank, &format!("greeting rank 0 at {addr}"), e))?;
    match read_answer(&mut s, deadline) {
        Ok(Ok(())) => {}
        Ok(Err(reason)) => return Err(io_err(rank, &format!("rank 0 at {addr} refused this process"), reason)),
        Err(e) => return Err(io_err(rank, &format!("waiting for rank 0 at {addr} to answer"), e)),
    }
    let mut blob = |what: &str| {
        read_blob_by(&mut s, deadline).map_err(|e| io_err(rank, &format!("receiving the {what} from rank 0"), e))
    };
    let (data, listing, job) = (blob("payload")?, blob("table")?, blob("job token")?);
    let job = JobId::new(&String::from_utf8_lossy(&job)).map_err(|e| io_err(rank, "job token from rank 0", e))?;
    let me = Rendezvous::watch(rank, job, vec![s])?;
    log::debug!("rank {rank}: joined job {} of {} ranks", me.job, env.world_size);
    let addrs = resolve(&String::from_utf8_lossy(&listing), &env.master_addr);
    Ok(Joined { payload: data, addrs, listener: mesh, rendezvous: me })
}

/// The `ip:port` table with rank 0's empty ip replaced by `master`.
fn resolve(listing: &str, master: &str) -> Vec<String> {
    listing.split(',').map(|a| if a.starts_with(':') { format!("{master}{a}") } else { a.to_string() }).collect()
}

enum Message {
    Heartbeat,
    Bye,
    Abort(String),
    Arrived { key: u64, size: usize },
    AllArrived(u64),
}

impl Meetings {
    /// Rank 0: `rank` reached meeting `key` of `size` ranks; once all have, each member
    /// hears so (rank 0 through `done`, the others through `G`).
    fn arrive(&self, peers: &[Mutex<TcpStream>], key: u64, size: usize, rank: usize) {
        let mut arrived = self.arrived.lock().unwrap_or_else(|e| e.into_inner());
        let here = arrived.entry(key).or_default();
        here.push(rank);
        if here.len() < size {
            return;
        }
        for r in arrived.remove(&key).unwrap_or_default() {
            if r == 0 {
                self.finish(key);
            } else {
                let mut s = peers[r - 1].lock().unwrap_or_else(|e| e.into_inner());
                let _ = s.write_all(b"G").and_then(|_| s.write_all(&key.to_le_bytes()));
            }
        }
    }

    /// Rank 0 is gone: no meeting can complete, so none is waited for.
    fn host_left(&self) {
        self.host_left.store(true, Ordering::SeqCst);
        self.news.notify_all();
    }

    /// Everyone reached meeting `key`.
    fn finish(&self, key: u64) {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).insert(key);
        self.news.notify_all();
    }
}

fn broadcast_abort(peers: &[Mutex<TcpStream>], reason: &str, skip: Option<usize>) {
    for (i, p) in peers.iter().enumerate() {
        if Some(i) != skip {
            let mut s = p.lock().unwrap_or_else(|e| e.into_inner());
            let _ = s.write_all(b"A").and_then(|_| write_blob(&mut *s, reason.as_bytes()));
        }
    }
}

fn read_message(s: &mut TcpStream) -> std::io::Result<Message> {
    let mut kind = [0u8; 1];
    s.read_exact(&mut kind)?;
    match kind[0] {
        b'H' => Ok(Message::Heartbeat),
        b'B' => Ok(Message::Bye),
        b'A' => Ok(Message::Abort(String::from_utf8_lossy(&read_blob(s)?).into_owned())),
        b'M' => {
            let key = read_u64(s)?;
            let [size] = read_u32s::<1>(s)?;
            Ok(Message::Arrived { key, size: u32::from_le(size) as usize })
        }
        b'G' => Ok(Message::AllArrived(read_u64(s)?)),
        other => Err(std::io::Error::other(format!("unknown message {other}"))),
    }
}

fn read_u32s<const N: usize>(s: &mut impl Read) -> std::io::Result<[u32; N]> {
    let mut v = [0u32; N];
    s.read_exact(bytemuck::cast_slice_mut(&mut v))?;
    Ok(v)
}

/// A little-endian u64 (a meeting's key).
fn read_u64(s: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_blob(s: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let [len] = read_u32s::<1>(s)?;
    let len = u32::from_le(len) as usize;
    if len > 1 << 20 {
        return Err(std::io::Error::other(format!("message of {len} bytes is not from moeflow")));
    }
    let mut v = vec![0u8; len];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// A TCP port that nothing listens on now, for a job's `MASTER_PORT`. It is taken from
/// 20000–32767, below Linux's ephemeral range (32768–60999), so the kernel does not hand it to
/// some other socket between this call and the job binding it (a port the kernel picked, freed
/// and picked again was a race: a test failed on it with "Address already in use"). Successive
/// calls in one process return different ports.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 20000;
    const COUNT: u32 = 32768 - FIRST;
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..COUNT {
        let port = (FIRST + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % COUNT) as u16;
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free port in 20000-32767"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(rank: usize, world: usize, port: u16) -> LaunchEnv {
        LaunchEnv::local(rank, world, port)
    }

    fn free_port() -> u16 {
        super::free_port().unwrap()
    }

    #[test]
    fn free_ports_lie_below_the_ephemeral_range_and_differ() {
        let (a, b) = (free_port(), free_port());
        assert!(a != b && (20000..32768).contains(&a) && (20000..32768).contains(&b), "{a} {b}");
        // Free for the job to bind, as rendezvous does.
        drop(TcpListener::bind(("0.0.0.0", a)).expect("the port is free"));
    }

    #[test]
    fn env_parsing() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(LaunchEnv::from_vars(vars(&[])).unwrap(), None);
        let e = LaunchEnv::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "1234")]))
            .unwrap()
            .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.master_port), (1, 4, 1, 1234));
        let bad = LaunchEnv::from_vars(vars(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err().to_string();
        assert!(bad.contains("RANK=4"), "{bad}");
        let bad = LaunchEnv::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "4")])).unwrap_err().to_string();
        assert!(bad.contains("RANK"), "{bad}");
        let bad = LaunchEnv::from_vars(vars(&[("RANK", "0")])).unwrap_err().to_string();
        assert!(bad.contains("WORLD_SIZE"), "{bad}");
    }

    #[test]
    fn payload_reaches_every_rank_and_failures_spread() {
        let port = free_port();
        let world = 3;
        let joined: Vec<(Vec<u8>, Rendezvous)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    s.spawn(move || {
                        Rendezvous::join(&env(r, world, port), || Ok(b"the id".to_vec()), Duration::from_secs(20))
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(joined.iter().all(|(p, _)| p == b"the id"));
        let mut ranks: Vec<Rendezvous> = joined.into_iter().map(|(_, r)| r).collect();
        assert!(ranks.iter().all(|r| r.failure().get().is_none()));
        // Rank 2's process vanishes without saying goodbye: everyone hears of it.
        let gone = ranks.pop().unwrap();
        for p in gone.peers.iter() {
            p.lock().unwrap().shutdown(Shutdown::Both).unwrap();
        }
        std::mem::forget(gone);
        let deadline = Instant::now() + Duration::from_secs(10);
        while ranks.iter().any(|r| r.failure().get().is_none()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        for r in &ranks {
            let f = r.failure().get().expect("failure seen");
            assert!(f.contains("rank 2"), "rank {}: {f}", r.rank());
        }
    }

    /// Three ranks of one job, joined.
    fn three_ranks() -> Vec<Rendezvous> {
        let port = free_port();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| s.spawn(move || Rendezvous::join(&env(r, 3, port), || Ok(vec![7]), Duration::from_secs(20))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap().1).collect()
        })
    }

    #[test]
    fn an_abort_reaches_every_rank() {
        let ranks = three_ranks();
        ranks[1].abort("rank 1 hit an error in all2allv dispatch");
        let deadline = Instant::now() + Duration::from_secs(10);
        while ranks.iter().any(|r| r.failure().get().is_none()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        for r in &ranks {
            assert_eq!(r.failure().get().as_deref(), Some("rank 1 hit an error in all2allv dispatch"));
        }
    }

    #[test]
    fn a_rank_that_stops_beating_is_named_silent_and_the_others_are_not() {
        let ranks = three_ranks();
        let quiet = 4 * HEARTBEAT;
        std::thread::sleep(2 * quiet);
        for r in &ranks {
            assert!(r.silent_peers(quiet).is_empty(), "rank {}: {:?}", r.rank(), r.silent_peers(quiet));
        }
        // Rank 2's heartbeats stop, its connection stays open (as a stopped process's does).
        ranks[2].closing.store(true, Ordering::SeqCst);
        std::thread::sleep(3 * quiet);
        let silent = ranks[0].silent_peers(quiet);
        assert_eq!(silent.iter().map(|&(p, _)| p).collect::<Vec<_>>(), vec![2], "{silent:?}");
        assert!(silent[0].1 >= 2 * quiet, "{silent:?}");
        assert!(ranks[1].silent_peers(quiet).is_empty());
        assert!(ranks.iter().all(|r| r.failure().get().is_none()), "silence is not a failure");
    }

    #[test]
    fn members_meet_with_or_without_rank_0_and_a_missing_member_ends_at_the_deadline() {
        let ranks = three_ranks();
        let soon = || Instant::now() + Duration::from_secs(10);
        let (start, left) = (Instant::now(), Mutex::new(Vec::new()));
        std::thread::scope(|s| {
            for (r, rdv) in ranks.iter().enumerate() {
                let left = &left;
                s.spawn(move || {
                    // Arrivals spread out: nobody leaves before the last one comes.
                    std::thread::sleep(Duration::from_millis(40 * r as u64));
                    assert!(rdv.meet(9, 3, soon(), || false), "rank {r}");
                    left.lock().unwrap().push((r, Instant::now()));
                    // Ranks 1 and 2 meet without rank 0, twice (distinct keys); alone, at once.
                    assert!(rdv.meet(10 + r as u64 * 100, 1, Instant::now(), || false));
                    if r > 0 {
                        assert!(rdv.meet(11, 2, soon(), || false), "rank {r}");
                        assert!(rdv.meet(12, 2, soon(), || false), "rank {r}");
                    }
                });
            }
        });
        let left = left.into_inner().unwrap();
        assert_eq!(left.len(), 3);
        assert!(left.iter().all(|&(_, t)| t >= start + Duration::from_millis(80)), "left before rank 2 came");
        // Rank 2 never comes to meeting 13: rank 1 gives up at its deadline, or on a failure.
        let start = Instant::now();
        assert!(!ranks[1].meet(13, 2, start + Duration::from_millis(200), || false));
        assert!(start.elapsed() >= Duration::from_millis(200) && start.elapsed() < Duration::from_secs(5));
        assert!(!ranks[1].meet(14, 2, soon(), || true));
        assert!(ranks.iter().all(|r| r.failure().get().is_none()));
    }

    #[test]
    fn meetings_end_at_once_when_rank_0_leaves() {
        let mut ranks = three_ranks().into_iter();
        let (r0, r1, r2) = (ranks.next().unwrap(), ranks.next().unwrap(), ranks.next().unwrap());
        let soon = Instant::now() + Duration::from_secs(10);
        let start = Instant::now();
        std::thread::scope(|s| {
            // Rank 1 waits for rank 2, which never comes; rank 0 leaves meanwhile.
            let waiting = s.spawn(|| r1.meet(20, 2, soon, || false));
            std::thread::sleep(Duration::from_millis(100));
            drop(r0);
            assert!(!waiting.join().unwrap(), "rank 1 met without rank 2");
        });
        // A meeting that starts after rank 0 left ends at once as well.
        assert!(!r2.meet(21, 2, soon, || false));
        assert!(start.elapsed() < Duration::from_secs(5), "waited {:?} for a job whose rank 0 left", start.elapsed());
        assert!(r1.failure().get().is_none() && r2.failure().get().is_none(), "a goodbye is not a failure");
    }

    #[test]
    fn missing_rank_times_out_with_a_named_error() {
        let port = free_port();
        let e = Rendezvous::join(&env(0, 3, port), || Ok(vec![1]), Duration::from_millis(300)).err().unwrap();
        assert!(e.to_string().contains("ranks [1, 2] never joined"), "{e}");
        let e = Rendezvous::join(&env(1, 3, free_port()), || Ok(vec![1]), Duration::from_millis(300)).err().unwrap();
        assert!(e.to_string().contains("connecting to rank 0"), "{e}");
    }

    fn with_job(mut e: LaunchEnv, job: &str) -> LaunchEnv {
        e.job = Some(JobId::new(job).unwrap());
        e
    }

    /// Joins `env` on a thread; the error text, or `Ok` with the joined rendezvous.
    fn spawn_join(
        env: LaunchEnv,
        timeout: Duration,
    ) -> std::thread::JoinHandle<std::result::Result<Rendezvous, String>> {
        std::thread::spawn(move || {
            Rendezvous::join(&env, || Ok(vec![5]), timeout).map(|(_, r)| r).map_err(|e| e.to_string())
        })
    }

    #[test]
    fn misfits_are_refused_with_the_reason_and_the_job_goes_on() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let job = |r: usize, w: usize, j: &str| with_job(env(r, w, port), j);
        let host = spawn_join(job(0, 3, "a"), t);
        let first = spawn_join(job(1, 3, "a"), t);
        // Wait until rank 1 is in: a second rank 1 is then refused as a duplicate.
        std::thread::sleep(Duration::from_millis(300));
        let refused = |e: LaunchEnv| {
            let start = Instant::now();
            let err = Rendezvous::join(&e, || Ok(vec![]), t).err().expect("refused").to_string();
            assert!(start.elapsed() < Duration::from_secs(5), "the refusal took {:?}", start.elapsed());
            err
        };
        let e = refused(job(1, 3, "a"));
        assert!(e.contains("rank 0 at 127.0.0.1") && e.contains("rank 1 is already taken"), "{e}");
        let e = refused(job(2, 3, "b"));
        assert!(e.contains("job mismatch") && e.contains("\"a\"") && e.contains("\"b\""), "{e}");
        let e = refused(env(2, 3, port));
        assert!(e.contains("job mismatch") && e.contains("newcomer's is none"), "{e}");
        let e = refused(job(2, 4, "a"));
        assert!(e.contains("this job has 3 ranks, the newcomer was started for 4"), "{e}");
        // The job's own rank 2 still completes it; a later rank 1 hears the job is complete.
        let last = spawn_join(job(2, 3, "a"), t);
        let ranks: Vec<Rendezvous> = [host, first, last].into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        assert!(ranks.iter().all(|r| r.job().as_str() == "a" && r.failure().get().is_none()));
        let e = refused(job(1, 3, "a"));
        assert!(e.contains("rank 1 is already taken") && e.contains("all 3 ranks of this job are running"), "{e}");
        assert!(ranks.iter().all(|r| r.failure().get().is_none()), "a refused newcomer failed the job");
    }

    #[test]
    fn a_rank_that_left_is_forgotten_and_named_and_strangers_change_nothing() {
        let port = free_port();
        let host = spawn_join(env(0, 3, port), Duration::from_millis(1500));
        // Strangers: garbage, a silent connection, a slow drip.
        std::thread::sleep(Duration::from_millis(100));
        let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
        garbage.write_all(b"\x16\x03\x01 garbage garbage garbage").unwrap();
        let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
        // Rank 1 joins and vanishes before rank 2 comes; rank 2 never does.
        let mut hello = Vec::new();
        Hello { channel: Channel::Rendezvous, rank: 1, world: 3, port: 0, job: None, listen_ip: None }
            .write(&mut hello)
            .unwrap();
        let mut gone = TcpStream::connect(("127.0.0.1", port)).unwrap();
        gone.write_all(&hello).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(gone);
        let start = Instant::now();
        let e = host.join().unwrap().err().expect("rank 0 fails");
        assert!(e.contains("during rendezvous") && e.contains("ranks [1, 2] never joined"), "{e}");
        assert!(e.contains("rank 1 joined and then left"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(3), "rank 0 overran its deadline");
        // A rank that joined hears why rank 0 gave up.
        let port = free_port();
        let host = spawn_join(env(0, 3, port), Duration::from_millis(800));
        let e = spawn_join(env(1, 3, port), Duration::from_secs(20)).join().unwrap().err().unwrap();
        assert!(e.contains("rank 0 timed out waiting for the others: ranks [2] never joined"), "{e}");
        assert!(host.join().unwrap().is_err());
    }

    #[test]
    fn rank_0_listens_on_master_addr_only() {
        let port = free_port();
        let host = spawn_join(env(0, 2, port), Duration::from_millis(800));
        std::thread::sleep(Duration::from_millis(100));
        // 127.0.0.2 is this host too (all of 127/8 is loopback), but not the address named.
        assert!(TcpStream::connect(("127.0.0.2", port)).is_err(), "rank 0 listens beyond MASTER_ADDR");
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(host.join().unwrap().is_err());
        // An explicit bind address wins.
        let port = free_port();
        let mut e = env(0, 2, port);
        e.bind = Some("127.0.0.2".parse().unwrap());
        let host = spawn_join(e, Duration::from_millis(800));
        std::thread::sleep(Duration::from_millis(100));
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        assert!(TcpStream::connect(("127.0.0.2", port)).is_ok());
        assert!(host.join().unwrap().is_err());
    }

    #[test]
    fn launcher_variables_name_a_bad_job_token_or_bind_address() {
        let vars = |extra: (&'static str, &'static str)| {
            move |k: &str| {
                [("RANK", "0"), ("WORLD_SIZE", "2"), extra].iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
            }
        };
        let e = LaunchEnv::from_vars(vars(("MOEFLOW_JOB", "job 7"))).unwrap_err().to_string();
        assert!(e.contains("MOEFLOW_JOB") && e.contains("' '"), "{e}");
        let e = LaunchEnv::from_vars(vars(("MOEFLOW_BIND", "eth0"))).unwrap_err().to_string();
        assert!(e.contains("MOEFLOW_BIND=\"eth0\" is not an IP address"), "{e}");
        let ok = LaunchEnv::from_vars(vars(("MOEFLOW_JOB", "j-1"))).unwrap().unwrap();
        assert_eq!((ok.job.unwrap().as_str(), ok.bind), ("j-1", None));
    }
}
