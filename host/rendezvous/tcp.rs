//! TCP endpoint. There is no file-system access control here: anyone who
//! can reach the port can connect (or bind it first), and the handshake
//! keyed by the id's secret is what keeps other processes out. Loopback
//! addresses are the intended use (this library is for the GPUs of one
//! host); see the module docs.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use super::{Conn, Listen};
use crate::error::{Error, Result};

/// Rank 0's listener; dropping it closes the port.
pub(crate) struct Listening {
    listener: TcpListener,
}

pub(crate) fn bind(addr: SocketAddr) -> Result<Listening> {
    if addr.port() == 0 {
        return Err(Error::invalid(format!(
            "rendezvous address {addr} has port 0: the other ranks must know the port, so choose one"
        )));
    }
    let listener = TcpListener::bind(addr).map_err(|e| {
        Error::io(format!("rank 0 binding the rendezvous TCP listener on {addr} (is the port free?)"), e)
    })?;
    listener.set_nonblocking(true).map_err(|e| Error::io("making the rendezvous listener non-blocking", e))?;
    Ok(Listening { listener })
}

impl Listen for Listening {
    fn accept(&self) -> io::Result<Option<Arc<dyn Conn>>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
                Ok(Some(Arc::new(stream)))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Where the other ranks dial: a wildcard bind address means "this host".
fn dial_addr(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port()),
        _ => addr,
    }
}

/// One attempt to reach rank 0, bounded by `timeout`.
pub(crate) fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<Arc<dyn Conn>> {
    let stream = TcpStream::connect_timeout(&dial_addr(addr), timeout)?;
    // Frames are small and each goes out in one write: do not let Nagle
    // hold one back waiting for an ACK.
    stream.set_nodelay(true)?;
    Ok(Arc::new(stream))
}

impl Conn for TcpStream {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&mut &*self).read(buf)
    }
    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        (&mut &*self).write(buf)
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
    fn disconnect(&self) {
        let _ = TcpStream::shutdown(self, Shutdown::Both);
    }
    fn peer_uid(&self) -> io::Result<Option<u32>> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_is_refused() {
        let err = bind("127.0.0.1:0".parse().unwrap()).err().expect("port 0");
        assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
    }

    #[test]
    fn wildcard_dials_loopback() {
        assert_eq!(dial_addr("0.0.0.0:9".parse().unwrap()), "127.0.0.1:9".parse().unwrap());
        assert_eq!(dial_addr("[::]:9".parse().unwrap()), "[::1]:9".parse().unwrap());
        assert_eq!(dial_addr("10.0.0.1:9".parse().unwrap()), "10.0.0.1:9".parse().unwrap());
    }
}
