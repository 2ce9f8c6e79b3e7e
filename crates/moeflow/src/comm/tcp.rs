//! Multi-process ranks without GPUs: [`TcpComm`], a full mesh of TCP connections between the
//! processes of a launched job (the rendezvous tells every rank where the others listen).
//!
//! Every message carries the collective's sequence number and name, so a rank that calls a
//! different collective is an error, not a wrong answer. Reads poll the job's [`Failure`]
//! flag (fed by the rendezvous liveness channel), so a dead or failed peer, or a deadline, ends
//! every pending collective with an error naming the rank and the operation. A sub-group from
//! `split` gets its own mesh, so that groups can be used from different threads at once.

use super::handshake::{accept, read_answer, refuse, Channel, Gate, Hello};
use super::{Communicator, Failure, JobId, LaunchEnv, Rendezvous};
use crate::error::{MoeError, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a blocked read waits before it re-checks the failure flag and the deadline.
const POLL: Duration = Duration::from_millis(20);

/// One rank of a group of processes connected over TCP.
pub struct TcpComm {
    rank: usize,
    size: usize,
    /// World rank of every member (for error messages).
    world: Vec<usize>,
    /// The host every member's listener is bound to (sub-groups listen there too).
    hosts: Vec<String>,
    /// `(reader, writer)` per peer; `None` at this rank's own index.
    peers: Mutex<Vec<Option<(TcpStream, TcpStream)>>>,
    seq: AtomicU64,
    failure: Failure,
    rendezvous: Arc<Rendezvous>,
    timeout: Duration,
}

fn io_err(rank: usize, op: &str, what: String) -> MoeError {
    MoeError::Comm { rank, op: op.into(), message: what }
}

impl TcpComm {
    /// Joins the job described by `env` (rank 0 at `MASTER_ADDR:MASTER_PORT`); every
    /// collective then fails after `timeout`.
    pub fn from_env(env: &LaunchEnv, timeout: Duration) -> Result<TcpComm> {
        let rank = env.rank;
        let deadline = Instant::now() + timeout;
        let joined = Rendezvous::join_listening(env, timeout)?;
        let listener = joined.listener.ok_or_else(|| io_err(rank, "mesh setup", "no mesh listener".into()))?;
        let rdv = Arc::new(joined.rendezvous);
        let failure = rdv.failure();
        // A failed mesh fails the job, so that no rank waits for this one until its deadline.
        let peers = mesh(rank, &joined.addrs, listener, rdv.job(), &failure, deadline)
            .inspect_err(|e| rdv.abort(&format!("rank {rank} could not connect the mesh: {e}")))?;
        log::debug!("rank {rank}: mesh of {} ranks connected", env.world_size);
        Ok(TcpComm {
            rank,
            size: env.world_size,
            world: (0..env.world_size).collect(),
            hosts: joined.addrs.iter().map(|a| host_of(a).to_string()).collect(),
            peers: Mutex::new(peers),
            seq: AtomicU64::new(0),
            failure,
            rendezvous: rdv,
            timeout,
        })
    }

    fn error(&self, op: &str, message: String) -> MoeError {
        MoeError::Comm { rank: self.world[self.rank], op: op.into(), message }
    }

    /// Records the failure for the whole job and returns the error.
    fn fail(&self, op: &str, message: String) -> MoeError {
        self.abort(&format!("rank {} in {op}: {message}", self.world[self.rank]));
        self.error(op, message)
    }
}

/// The host part of `host:port` (`[v6]` keeps its brackets).
fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// Connects every pair of ranks: each dials the listeners of the lower ranks (presenting the
/// job token, its rank and the group size, and waiting to be accepted) and accepts one
/// connection from each higher rank through a [`Gate`], which closes strangers and refuses
/// hellos that do not fit. Ends early, with the reason, once the job has failed.
fn mesh(
    rank: usize,
    addrs: &[String],
    listener: TcpListener,
    job: &JobId,
    failure: &Failure,
    deadline: Instant,
) -> Result<Vec<Option<(TcpStream, TcpStream)>>> {
    let n = addrs.len();
    let err = |what: String| io_err(rank, "mesh setup", what);
    let failed = || failure.get().map(|reason| err(format!("group failed: {reason}")));
    let gate = Gate::open(listener, format!("rank {rank} mesh")).map_err(|e| err(format!("listening: {e}")))?;
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    for (peer, addr) in addrs.iter().enumerate().take(rank) {
        let mut s = loop {
            if let Some(e) = failed() {
                return Err(e);
            }
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(err(format!("rank {peer} at {addr}: {e}"))),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let hello = Hello { channel: Channel::Mesh, rank, world: n, port: 0, job: Some(job.clone()), listen_ip: None };
        hello.write(&mut s).map_err(|e| err(format!("greeting rank {peer} at {addr}: {e}")))?;
        // The peer answers once it starts accepting: wait for the first byte, watching the job.
        loop {
            if let Some(e) = failed() {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(err(format!("rank {peer} at {addr} did not accept this rank in time")));
            }
            s.set_read_timeout(Some(POLL * 5)).map_err(|e| err(e.to_string()))?;
            match s.peek(&mut [0u8; 1]) {
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                _ => break,
            }
        }
        match read_answer(&mut s, deadline) {
            Ok(Ok(())) => {}
            Ok(Err(reason)) => return Err(err(format!("rank {peer} at {addr} refused this rank: {reason}"))),
            Err(e) => return Err(err(format!("waiting for rank {peer} at {addr} to accept: {e}"))),
        }
        streams[peer] = Some(s);
    }
    while streams.iter().enumerate().any(|(r, s)| r > rank && s.is_none()) {
        if let Some(e) = failed() {
            return Err(e);
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (rank + 1..n).filter(|&r| streams[r].is_none()).collect();
            return Err(err(format!("ranks {missing:?} never connected")));
        }
        let Some(mut a) = gate.next(deadline.min(Instant::now() + POLL * 5)) else { continue };
        let h = &a.hello;
        match h.mismatch(Channel::Mesh, Some(job), n, rank + 1..n, |r| streams[r].is_some()) {
            Some(reason) => {
                log::debug!("rank {rank} mesh: refused {} (rank {} of {}): {reason}", a.from, h.rank, h.world);
                refuse(a.stream, &reason);
            }
            None => {
                accept(&mut a.stream).map_err(|e| err(format!("accepting rank {}: {e}", h.rank)))?;
                streams[h.rank] = Some(a.stream);
            }
        }
    }
    streams
        .into_iter()
        .map(|s| {
            s.map(|s| {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(POLL))?;
                Ok((s.try_clone()?, s))
            })
            .transpose()
            .map_err(|e: std::io::Error| err(e.to_string()))
        })
        .collect()
}

/// Why a read stopped.
enum ReadStop {
    Io(std::io::Error),
    Failed(String),
    Deadline,
}

/// Fills `buf` from `s`, re-checking `failure` and `deadline` whenever the socket is idle.
fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    failure: &Failure,
    deadline: Instant,
) -> std::result::Result<(), ReadStop> {
    let mut off = 0;
    while off < buf.len() {
        match s.read(&mut buf[off..]) {
            Ok(0) => return Err(ReadStop::Io(std::io::Error::new(ErrorKind::UnexpectedEof, "connection closed"))),
            Ok(n) => off += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                if let Some(reason) = failure.get() {
                    return Err(ReadStop::Failed(reason));
                }
                if Instant::now() >= deadline {
                    return Err(ReadStop::Deadline);
                }
            }
            Err(e) => return Err(ReadStop::Io(e)),
        }
    }
    Ok(())
}

/// One message: `[seq u64, op length u32, payload length u64]`, the op name, the payload.
fn message(seq: u64, op: &str, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(20 + op.len() + data.len());
    m.extend_from_slice(&seq.to_le_bytes());
    m.extend_from_slice(&(op.len() as u32).to_le_bytes());
    m.extend_from_slice(&(data.len() as u64).to_le_bytes());
    m.extend_from_slice(op.as_bytes());
    m.extend_from_slice(data);
    m
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all_v(&self, op: &str, mut parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if let Some(reason) = self.failure.get() {
            return Err(self.error(op, format!("group failed: {reason}")));
        }
        if parts.len() != self.size {
            return Err(self.fail(op, format!("{} parts for {} ranks", parts.len(), self.size)));
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + self.timeout;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let mut got: Vec<Vec<u8>> = vec![Vec::new(); self.size];
        got[self.rank] = std::mem::take(&mut parts[self.rank]);
        let (readers, writers): (Vec<_>, Vec<_>) =
            peers.iter_mut().map(|p| p.as_mut().map(|(r, w)| (r, w)).unzip()).unzip();
        let outcome = std::thread::scope(|scope| {
            // Writers run beside the reads, so that large messages cannot fill both ways' buffers.
            let sending: Vec<_> = writers
                .into_iter()
                .zip(&parts)
                .enumerate()
                .filter_map(|(peer, (w, data))| w.map(|w| (peer, w, data)))
                .map(|(peer, w, data)| {
                    let msg = message(seq, op, data);
                    scope.spawn(move || {
                        w.set_write_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(POLL)))
                            .and_then(|_| w.write_all(&msg))
                            .map_err(|e| (peer, e))
                    })
                })
                .collect();
            let mut result = Ok(());
            for (peer, r) in readers.into_iter().enumerate() {
                let Some(r) = r else { continue };
                let mut head = [0u8; 20];
                let read = read_full(r, &mut head, &self.failure, deadline).and_then(|_| {
                    let their_seq = u64::from_le_bytes(head[0..8].try_into().expect("8 bytes"));
                    let op_len = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
                    let len = u64::from_le_bytes(head[12..20].try_into().expect("8 bytes")) as usize;
                    let mut name = vec![0u8; op_len];
                    read_full(r, &mut name, &self.failure, deadline)?;
                    let mut data = vec![0u8; len];
                    read_full(r, &mut data, &self.failure, deadline)?;
                    Ok((their_seq, String::from_utf8_lossy(&name).into_owned(), data))
                });
                let who = self.world[peer];
                result = match read {
                    Ok((s, name, _)) if s != seq || name != op => Err(self.fail(
                        op,
                        format!("rank {who} called {name} (collective #{s}) while this rank called {op} (#{seq})"),
                    )),
                    Ok((_, _, data)) => {
                        got[peer] = data;
                        Ok(())
                    }
                    Err(ReadStop::Failed(reason)) => Err(self.error(op, format!("group failed: {reason}"))),
                    Err(ReadStop::Deadline) => {
                        Err(self.fail(op, format!("timed out after {:?} waiting for rank {who}", self.timeout)))
                    }
                    Err(ReadStop::Io(e)) => Err(self.fail(op, format!("lost rank {who}: {e}"))),
                };
                if result.is_err() {
                    break;
                }
            }
            for h in sending {
                match h.join() {
                    Ok(Ok(())) => {}
                    Ok(Err((peer, e))) if result.is_ok() => {
                        result = Err(self.fail(op, format!("sending to rank {}: {e}", self.world[peer])));
                    }
                    _ => {}
                }
            }
            result
        });
        outcome.map(|_| got)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        let here = &self.hosts[self.rank];
        let listener = TcpListener::bind(format!("{here}:0"))
            .map_err(|e| self.error("split", format!("listening on {here}: {e}")))?;
        let port = listener.local_addr().map_err(|e| self.error("split", e.to_string()))?.port() as u64;
        let all: Vec<Vec<u64>> = super::CommExt::all_gather_vec(self, "split", &[color as u64, key as u64, port])?;
        let mut members: Vec<(u64, usize)> =
            all.iter().enumerate().filter(|(_, v)| v[0] == color as u64).map(|(r, v)| (v[1], r)).collect();
        members.sort();
        let sub_rank = members.iter().position(|&(_, r)| r == self.rank).expect("this rank has its own color");
        let addrs: Vec<String> = members.iter().map(|&(_, r)| format!("{}:{}", self.hosts[r], all[r][2])).collect();
        let deadline = Instant::now() + self.timeout;
        let peers =
            mesh(sub_rank, &addrs, listener, self.rendezvous.job(), &self.failure, deadline).inspect_err(|e| {
                self.abort(&format!("rank {} could not connect a sub-group: {e}", self.world[self.rank]))
            })?;
        Ok(Box::new(TcpComm {
            rank: sub_rank,
            size: members.len(),
            world: members.iter().map(|&(_, r)| self.world[r]).collect(),
            hosts: members.iter().map(|&(_, r)| self.hosts[r].clone()).collect(),
            peers: Mutex::new(peers),
            seq: AtomicU64::new(0),
            failure: self.failure.clone(),
            rendezvous: self.rendezvous.clone(),
            timeout: self.timeout,
        }))
    }

    fn abort(&self, reason: &str) {
        self.rendezvous.abort(reason);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CommExt;

    /// Runs `f` on `world` ranks joined over localhost TCP (threads standing in for
    /// processes) and returns their results by rank.
    fn on_tcp<T: Send>(world: usize, timeout: Duration, f: impl Fn(TcpComm) -> T + Sync) -> Vec<T> {
        let port = crate::comm::free_port().unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let env = LaunchEnv::local(rank, world, port);
                        f(TcpComm::from_env(&env, timeout).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_and_splits_over_tcp() {
        let world = 4;
        on_tcp(world, Duration::from_secs(30), |c| {
            let r = c.rank();
            // Uneven parts, some empty, one large (more than a socket buffer).
            let len = |src: usize, dst: usize| if src == 1 && dst == 2 { 3 << 20 } else { (src * 5 + dst * 3) % 7 };
            let parts = (0..world).map(|d| vec![(r * 16 + d) as u8; len(r, d)]).collect();
            let got = c.all_to_all_v("test", parts).unwrap();
            for (src, p) in got.iter().enumerate() {
                assert_eq!(p.len(), len(src, r));
                assert!(p.iter().all(|&b| b == (src * 16 + r) as u8));
            }
            assert_eq!(c.all_reduce_sum("sum", &[r as f32, 1.0]).unwrap(), vec![6.0, 4.0]);
            let sub = c.split(r % 2, world - r).unwrap();
            assert_eq!(sub.size(), 2);
            let members: Vec<Vec<u32>> = sub.all_gather_vec("sub", &[r as u32]).unwrap();
            let want: Vec<u32> = if r.is_multiple_of(2) { vec![2, 0] } else { vec![3, 1] };
            assert_eq!(members.concat(), want);
        });
    }

    #[test]
    fn a_silent_rank_times_out_and_then_hears_of_the_failure() {
        let results = on_tcp(2, Duration::from_millis(500), |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            c.all_to_all_v("late", vec![vec![9]; 2]).unwrap_err().to_string()
        });
        assert!(results[0].contains("timed out after 500ms waiting for rank 1"), "{}", results[0]);
        assert!(results[1].contains("group failed") && results[1].contains("rank 0 in late"), "{}", results[1]);
    }

    #[test]
    fn a_lost_rank_and_a_mismatch_fail_every_rank_with_named_errors() {
        let world = 3;
        let results = on_tcp(world, Duration::from_secs(20), |c| {
            c.barrier().unwrap();
            if c.rank() == 2 {
                // This process ends without a word: its sockets close.
                std::mem::forget(c.rendezvous.clone());
                drop(c);
                return Ok(());
            }
            c.all_to_all_v("after the loss", vec![vec![1]; world]).map(|_| ()).map_err(|e| e.to_string())
        });
        for r in &results[..2] {
            let e = r.as_ref().unwrap_err();
            assert!(e.contains("rank 2") && e.contains("after the loss"), "{e}");
        }
        let results = on_tcp(2, Duration::from_secs(20), |c| {
            let op = if c.rank() == 0 { "dispatch" } else { "combine" };
            c.all_to_all_v(op, vec![vec![]; 2]).unwrap_err().to_string()
        });
        assert!(results[0].contains("rank 1 called combine"), "{}", results[0]);
    }

    #[test]
    fn the_mesh_ignores_strangers_refuses_misfits_and_ends_when_the_job_fails() {
        let listen = || TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let (l0, l1) = (listen(), listen());
        let addrs = vec![l0.local_addr().unwrap().to_string(), l1.local_addr().unwrap().to_string()];
        let (job, failure) = (JobId::new("mine").unwrap(), Failure::default());
        let deadline = Instant::now() + Duration::from_secs(20);
        std::thread::scope(|s| {
            let rank0 = s.spawn(|| mesh(0, &addrs, l0, &job, &failure, deadline));
            let mut garbage = TcpStream::connect(&addrs[0]).unwrap();
            garbage.write_all(b"GIOP\x01\x02 this is not a hello at all").unwrap();
            let _silent = TcpStream::connect(&addrs[0]).unwrap();
            let answer = |hello: Hello| {
                let mut c = TcpStream::connect(&addrs[0]).unwrap();
                hello.write(&mut c).unwrap();
                read_answer(&mut c, Instant::now() + Duration::from_secs(5)).unwrap().unwrap_err()
            };
            let hello = |world, job: &str| Hello {
                channel: Channel::Mesh,
                rank: 1,
                world,
                port: 0,
                job: Some(JobId::new(job).unwrap()),
                listen_ip: None,
            };
            assert!(answer(hello(2, "theirs")).contains("job mismatch"));
            assert!(answer(hello(3, "mine")).contains("this job has 2 ranks"));
            let rank1 = mesh(1, &addrs, l1, &job, &failure, deadline).unwrap();
            assert!(rank1[0].is_some() && rank1[1].is_none());
            assert!(rank0.join().unwrap().unwrap()[1].is_some());
        });
        // Rank 1 never dials; the job fails meanwhile (its liveness channel saw rank 1 die).
        let start = Instant::now();
        let failure = Failure::default();
        let l0 = listen();
        let addrs = vec![l0.local_addr().unwrap().to_string(), "127.0.0.1:9".into()];
        std::thread::scope(|s| {
            let rank0 = s.spawn(|| mesh(0, &addrs, l0, &job, &failure, deadline));
            std::thread::sleep(Duration::from_millis(100));
            failure.set("rank 1 exited or lost its connection");
            let e = rank0.join().unwrap().err().unwrap().to_string();
            assert!(e.contains("during mesh setup: group failed: rank 1 exited"), "{e}");
        });
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_rank_whose_mesh_fails_fails_the_job_at_once() {
        // Rank 2 joins the rendezvous but never connects its mesh; rank 0 gives up after a
        // second, and rank 1 (whose deadline is far) hears of it at once.
        let port = crate::comm::free_port().unwrap();
        let start = Instant::now();
        let (r0, r1, r2) = std::thread::scope(|s| {
            let r0 = s.spawn(|| TcpComm::from_env(&LaunchEnv::local(0, 3, port), Duration::from_secs(1)).err());
            let r1 = s.spawn(|| TcpComm::from_env(&LaunchEnv::local(1, 3, port), Duration::from_secs(30)).err());
            let r2 = s.spawn(|| {
                let (_, rdv) = Rendezvous::join(&LaunchEnv::local(2, 3, port), || Ok(vec![]), Duration::from_secs(30))
                    .expect("rank 2 joins");
                let deadline = Instant::now() + Duration::from_secs(20);
                while rdv.failure().get().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                rdv.failure().get()
            });
            (r0.join().unwrap(), r1.join().unwrap(), r2.join().unwrap())
        });
        let (e0, e1) = (r0.expect("rank 0 fails").to_string(), r1.expect("rank 1 fails").to_string());
        assert!(e0.contains("during mesh setup") && e0.contains("ranks [2] never connected"), "{e0}");
        assert!(e1.contains("during mesh setup: group failed: rank 0 could not connect the mesh"), "{e1}");
        assert!(r2.expect("rank 2 hears").contains("rank 0 could not connect the mesh"));
        assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    }
}
