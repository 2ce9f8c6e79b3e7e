//! The handshake every connection between the ranks of a job opens with, and [`Gate`]: a
//! listener that screens its connections, so that strangers on its port (a port scanner, a
//! health probe, a process of another job) cannot disturb the job.
//!
//! Wire format (little-endian): a hello `[magic u32, channel u8, rank u32, world u32, port
//! u32]` followed by the job token and the address the sender's own listener is bound to, each
//! as `[len u8, bytes]` (empty: none). The listener answers `K` (accepted) or `R` +
//! `[len u32, reason]` (refused, with what did not match). A connection that has not sent a
//! well-formed hello within [`HANDSHAKE_DEADLINE`] is closed and logged at debug level; the
//! listener keeps serving.

use super::job::JobId;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x6d6f_6566; // "moef"

/// How long a new connection has to send its hello before it is closed.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(3);

/// Connections a gate screens at once (each on a small thread of its own); more are closed
/// unread. A real rank's hello takes microseconds, so only a flood of more than this many
/// silent connections within [`HANDSHAKE_DEADLINE`] could crowd one out.
const MAX_SCREENING: usize = 512;

/// Stack of a screening thread: it reads a hello of a few dozen bytes.
const SCREENING_STACK: usize = 64 << 10;

/// Largest blob (payload, address table, reason) a peer may announce.
const MAX_BLOB: usize = 1 << 20;

/// What a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Channel {
    /// To rank 0: the rendezvous, then the job's liveness channel.
    Rendezvous,
    /// Between two ranks of a TCP mesh (collectives).
    Mesh,
}

impl Channel {
    fn byte(self) -> u8 {
        match self {
            Channel::Rendezvous => b'R',
            Channel::Mesh => b'M',
        }
    }

    fn name(self) -> &'static str {
        match self {
            Channel::Rendezvous => "rendezvous",
            Channel::Mesh => "mesh",
        }
    }
}

/// Who a connecting process says it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// What the connection is for.
    pub channel: Channel,
    /// The sender's rank.
    pub rank: usize,
    /// The sender's world (or sub-group) size.
    pub world: usize,
    /// The port the sender's own listener has (0: none).
    pub port: u16,
    /// The job token the sender was given (none: it was started without one).
    pub job: Option<JobId>,
    /// The address the sender's listener is bound to, when it was told one; otherwise peers
    /// reach it at the address its connection comes from.
    pub listen_ip: Option<IpAddr>,
}

impl Hello {
    /// Sends this hello.
    pub fn write(&self, s: &mut impl Write) -> io::Result<()> {
        let mut m = Vec::with_capacity(96);
        m.extend_from_slice(&MAGIC.to_le_bytes());
        m.push(self.channel.byte());
        for v in [self.rank, self.world, usize::from(self.port)] {
            m.extend_from_slice(&(v as u32).to_le_bytes());
        }
        let job = self.job.as_ref().map_or("", |j| j.as_str());
        let ip = self.listen_ip.map(|ip| ip.to_string()).unwrap_or_default();
        for text in [job, ip.as_str()] {
            m.push(text.len() as u8);
            m.extend_from_slice(text.as_bytes());
        }
        s.write_all(&m)
    }

    /// Reads a hello from `s`; an error unless a well-formed one arrives before `deadline`.
    pub fn read(s: &mut TcpStream, deadline: Instant) -> io::Result<Hello> {
        // The magic alone first, so that a stranger is turned away as soon as it shows.
        let mut head = [0u8; 17];
        read_exact_by(s, &mut head[..4], deadline)?;
        if head[..4] != MAGIC.to_le_bytes() {
            return Err(invalid(format!("not a moeflow hello (starts with {:02x?})", &head[..4])));
        }
        read_exact_by(s, &mut head[4..], deadline)?;
        let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
        let channel = match head[4] {
            b'R' => Channel::Rendezvous,
            b'M' => Channel::Mesh,
            other => return Err(invalid(format!("unknown channel {other}"))),
        };
        let (rank, world) = (word(5) as usize, word(9) as usize);
        let port = u16::try_from(word(13)).map_err(|_| invalid(format!("port {} out of range", word(13))))?;
        let mut text = || -> io::Result<String> {
            let mut len = [0u8; 1];
            read_exact_by(s, &mut len, deadline)?;
            let mut b = vec![0u8; len[0] as usize];
            read_exact_by(s, &mut b, deadline)?;
            String::from_utf8(b).map_err(|_| invalid("a field is not UTF-8".into()))
        };
        let (job, ip) = (text()?, text()?);
        let job = match job.as_str() {
            "" => None,
            j => Some(JobId::new(j).map_err(|e| invalid(e.to_string()))?),
        };
        let listen_ip = match ip.as_str() {
            "" => None,
            ip => Some(ip.parse().map_err(|_| invalid(format!("listen address {ip:?} is not an IP")))?),
        };
        Ok(Hello { channel, rank, world, port, job, listen_ip })
    }

    /// Why this hello does not fit a listener of `channel` for job `job` (none: started
    /// without a token) with `world` ranks, which takes the ranks in `ranks` not yet `taken`;
    /// `None` when it fits.
    pub fn mismatch(
        &self,
        channel: Channel,
        job: Option<&JobId>,
        world: usize,
        ranks: std::ops::Range<usize>,
        taken: impl Fn(usize) -> bool,
    ) -> Option<String> {
        let token = |j: Option<&JobId>| j.map_or("none".to_string(), |j| format!("{:?}", j.as_str()));
        Some(if self.channel != channel {
            format!("this port serves a {}, not a {}", channel.name(), self.channel.name())
        } else if self.job.as_ref() != job {
            format!(
                "job mismatch: this job's token is {}, the newcomer's is {} (a process of another job reached this port)",
                token(job),
                token(self.job.as_ref())
            )
        } else if self.world != world {
            format!("world size mismatch: this job has {world} ranks, the newcomer was started for {}", self.world)
        } else if !ranks.contains(&self.rank) {
            format!("rank {} is out of range: this listener takes ranks {}..{}", self.rank, ranks.start, ranks.end)
        } else if taken(self.rank) {
            format!("rank {} is already taken: another process joined as rank {}", self.rank, self.rank)
        } else {
            return None;
        })
    }
}

fn invalid(what: String) -> io::Error {
    io::Error::new(ErrorKind::InvalidData, what)
}

/// Fills `buf` from `s`, failing with `TimedOut` at `deadline` however slowly the bytes come.
pub(crate) fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(ErrorKind::TimedOut, format!("{off} of {} bytes came in time", buf.len())));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[off..]) {
            Ok(0) => return Err(io::Error::new(ErrorKind::UnexpectedEof, "the connection closed")),
            Ok(n) => off += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Sends `data` as `[len u32, bytes]`.
pub(crate) fn write_blob(s: &mut impl Write, data: &[u8]) -> io::Result<()> {
    s.write_all(&(data.len() as u32).to_le_bytes())?;
    s.write_all(data)
}

/// Reads a `[len u32, bytes]` blob of at most 1 MiB before `deadline`.
pub(crate) fn read_blob_by(s: &mut TcpStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(s, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_BLOB {
        return Err(invalid(format!("a message of {len} bytes is not from moeflow")));
    }
    let mut v = vec![0u8; len];
    read_exact_by(s, &mut v, deadline)?;
    Ok(v)
}

/// Tells the newcomer on `s` that it was accepted.
pub(crate) fn accept(s: &mut TcpStream) -> io::Result<()> {
    s.write_all(b"K")
}

/// Tells the newcomer on `s` why it was refused, and closes the connection.
pub(crate) fn refuse(mut s: TcpStream, reason: &str) {
    let _ = s.write_all(b"R").and_then(|_| write_blob(&mut s, reason.as_bytes()));
    let _ = s.shutdown(Shutdown::Write);
}

/// The listener's answer to this process's hello: `Ok(Ok(()))` when accepted, `Ok(Err(reason))`
/// when refused.
pub(crate) fn read_answer(s: &mut TcpStream, deadline: Instant) -> io::Result<Result<(), String>> {
    let mut kind = [0u8; 1];
    read_exact_by(s, &mut kind, deadline)?;
    match kind[0] {
        b'K' => Ok(Ok(())),
        b'R' => Ok(Err(String::from_utf8_lossy(&read_blob_by(s, deadline)?).into_owned())),
        other => Err(invalid(format!("answered {other:#04x}, which no moeflow rank sends"))),
    }
}

/// A connection that sent a well-formed hello.
pub(crate) struct Arrival {
    /// The connection (blocking, no read timeout).
    pub stream: TcpStream,
    /// What it said.
    pub hello: Hello,
    /// Where it came from.
    pub from: SocketAddr,
}

/// A listener served on a thread of its own: each connection gets [`HANDSHAKE_DEADLINE`] (on a
/// thread of its own, so a slow one delays nobody) to send a hello; those that do are handed
/// out by [`Gate::next`], the rest are closed and logged at debug level. Dropping the gate
/// closes the listener.
pub(crate) struct Gate {
    arrivals: Receiver<Arrival>,
    open: Arc<AtomicBool>,
}

impl Gate {
    /// Starts serving `listener`; `what` names it in the log.
    pub fn open(listener: TcpListener, what: String) -> io::Result<Gate> {
        listener.set_nonblocking(true)?;
        let (tx, arrivals) = channel();
        let open = Arc::new(AtomicBool::new(true));
        let screening = Arc::new(AtomicUsize::new(0));
        let still_open = open.clone();
        std::thread::spawn(move || {
            while still_open.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut stream, from)) => {
                        if screening.fetch_add(1, Ordering::SeqCst) >= MAX_SCREENING {
                            screening.fetch_sub(1, Ordering::SeqCst);
                            log::debug!("{what}: closed a connection from {from}: {MAX_SCREENING} others are screened");
                            continue;
                        }
                        let (tx, name, count) = (tx.clone(), what.clone(), screening.clone());
                        let screen = move || {
                            let deadline = Instant::now() + HANDSHAKE_DEADLINE;
                            let read = stream.set_nonblocking(false).and_then(|_| Hello::read(&mut stream, deadline));
                            count.fetch_sub(1, Ordering::SeqCst);
                            match read.and_then(|hello| stream.set_read_timeout(None).map(|_| hello)) {
                                Ok(hello) => {
                                    let _ = tx.send(Arrival { stream, hello, from });
                                }
                                Err(e) => log::debug!(
                                    "{name}: closed a connection from {from} without a valid handshake \
                                     within {HANDSHAKE_DEADLINE:?}: {e}"
                                ),
                            }
                        };
                        if let Err(e) = std::thread::Builder::new().stack_size(SCREENING_STACK).spawn(screen) {
                            screening.fetch_sub(1, Ordering::SeqCst);
                            log::debug!("{what}: closed a connection from {from}: no thread to screen it: {e}");
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => {
                        log::debug!("{what}: accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
        });
        Ok(Gate { arrivals, open })
    }

    /// The next connection that completed a hello, waiting until `until` at most.
    pub fn next(&self, until: Instant) -> Option<Arrival> {
        self.arrivals.recv_timeout(until.saturating_duration_since(Instant::now())).ok()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(rank: usize, job: Option<&str>) -> Hello {
        Hello {
            channel: Channel::Mesh,
            rank,
            world: 3,
            port: 4242,
            job: job.map(|j| JobId::new(j).unwrap()),
            listen_ip: Some("10.0.0.7".parse().unwrap()),
        }
    }

    #[test]
    fn strangers_are_closed_and_a_real_hello_still_gets_through() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = Gate::open(listener, "test".into()).unwrap();
        let start = Instant::now();
        // Garbage, a silent (half-open) connection, and one that drips a valid-looking start.
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let _silent = TcpStream::connect(addr).unwrap();
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(&MAGIC.to_le_bytes()).unwrap();
        let mut good = TcpStream::connect(addr).unwrap();
        hello(2, Some("job-a")).write(&mut good).unwrap();
        let a = gate.next(Instant::now() + Duration::from_secs(2)).expect("the real hello is handed out");
        assert_eq!(a.hello, hello(2, Some("job-a")));
        assert!(start.elapsed() < Duration::from_secs(1), "a stranger delayed a real rank");
        // The garbage is closed at once (reset, as it left unread bytes), the others at the
        // handshake deadline; none comes out.
        let closed = |s: &mut TcpStream, within: Duration| {
            s.set_read_timeout(Some(within)).unwrap();
            match s.read(&mut [0u8; 1]) {
                Ok(0) => true,
                Err(e) => e.kind() == ErrorKind::ConnectionReset,
                Ok(_) => false,
            }
        };
        assert!(closed(&mut garbage, Duration::from_secs(2)));
        let start = Instant::now();
        assert!(closed(&mut slow, HANDSHAKE_DEADLINE + Duration::from_secs(2)));
        assert!(start.elapsed() < HANDSHAKE_DEADLINE + Duration::from_secs(1));
        assert!(gate.next(Instant::now() + Duration::from_millis(100)).is_none());
    }

    #[test]
    fn mismatches_are_named() {
        let job = JobId::new("job-a").unwrap();
        let fits = |h: &Hello, taken: bool| h.mismatch(Channel::Mesh, Some(&job), 3, 1..3, |_| taken);
        assert_eq!(fits(&hello(2, Some("job-a")), false), None);
        assert!(fits(&hello(2, Some("job-b")), false).unwrap().contains("job mismatch"));
        assert!(fits(&hello(2, None), false).unwrap().contains("the newcomer's is none"));
        assert!(fits(&hello(2, Some("job-a")), true).unwrap().contains("rank 2 is already taken"));
        assert!(fits(&hello(3, Some("job-a")), false).unwrap().contains("rank 3 is out of range"));
        let other_world = Hello { world: 4, ..hello(2, Some("job-a")) };
        assert!(fits(&other_world, false).unwrap().contains("this job has 3 ranks, the newcomer was started for 4"));
        let rendezvous = Hello { channel: Channel::Rendezvous, ..hello(2, Some("job-a")) };
        assert!(fits(&rendezvous, false).unwrap().contains("serves a mesh"));
    }
}
