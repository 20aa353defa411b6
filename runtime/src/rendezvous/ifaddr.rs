//! Which local address to listen on and advertise.
//!
//! `TUTTI_SOCKET_IFNAME` takes NCCL's `NCCL_SOCKET_IFNAME` syntax: a comma-separated list of
//! interface-name prefixes (`eth,ib`), `^` in front to exclude them instead (`^docker,lo`), and `=`
//! in front to match names exactly (`=eth0`). Without it, the address of the interface that
//! routes to `MASTER_ADDR` is used: loopback only when the master itself is on loopback (a
//! single-host job), so a multi-host world never advertises loopback. With no master address
//! (a file store), the interface of the default route; without one, the first IPv4 address on
//! an interface that is neither loopback nor a container or VM bridge ([`VIRTUAL`]).

use std::net::{IpAddr, SocketAddr, UdpSocket};

use crate::error::{Error, Result};

/// A parsed `TUTTI_SOCKET_IFNAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfSpec {
    /// `^`: the names are excluded.
    pub exclude: bool,
    /// `=`: names match exactly rather than by prefix.
    pub exact: bool,
    /// The names or prefixes.
    pub names: Vec<String>,
}

impl std::str::FromStr for IfSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<IfSpec> {
        let mut rest = s.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names: Vec<String> =
            rest.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect();
        if names.is_empty() {
            return Err(Error::Config(format!("TUTTI_SOCKET_IFNAME={s:?} names no interface")));
        }
        Ok(IfSpec { exclude, exact, names })
    }
}

impl IfSpec {
    /// Does interface `name` pass this filter?
    pub fn matches(&self, name: &str) -> bool {
        let hit =
            self.names.iter().any(|n| if self.exact { name == n } else { name.starts_with(n) });
        hit != self.exclude
    }
}

/// Every (interface name, address) of this host.
///
/// # Errors
/// [`Error::Io`] when the OS refuses to list interfaces.
pub fn interfaces() -> Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io(usize::MAX, "listing interfaces", &std::io::Error::last_os_error()));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null C string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        // SAFETY: `ifa_addr` is non-null and its family says which sockaddr it is.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if let Some(ip) = ip {
            out.push((name, ip));
        }
    }
    // SAFETY: freeing the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

fn usable(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(_) => true,
        // Link-local IPv6 needs a scope id that does not travel in a plain address string.
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
    }
}

/// Name prefixes of the bridges and links that container and VM runtimes create (Docker, libvirt,
/// CNI plugins, LXC/LXD, Podman): never chosen without `TUTTI_SOCKET_IFNAME` (other hosts cannot
/// reach them).
pub const VIRTUAL: &[&str] =
    &["lo", "docker", "br-", "virbr", "veth", "cni", "flannel", "cali", "lxc", "lxd", "podman"];

/// Choose the address to listen on and advertise.
///
/// # Errors
/// [`Error::Config`] naming `TUTTI_SOCKET_IFNAME` when it matches no interface (the message lists
/// the interfaces there are).
pub fn select(spec: Option<&IfSpec>, master: Option<IpAddr>) -> Result<IpAddr> {
    if let Some(spec) = spec {
        let all = interfaces()?;
        let mut cands: Vec<&(String, IpAddr)> =
            all.iter().filter(|(n, ip)| spec.matches(n) && usable(ip)).collect();
        // Prefer the master's address family, then IPv4.
        cands.sort_by_key(|(_, ip)| {
            (master.is_some_and(|m| m.is_ipv4() != ip.is_ipv4()), !ip.is_ipv4())
        });
        return cands.first().map(|(_, ip)| *ip).ok_or_else(|| {
            let names: Vec<String> = all.iter().map(|(n, ip)| format!("{n} ({ip})")).collect();
            Error::Config(format!(
                "TUTTI_SOCKET_IFNAME={}{}{} matches no usable interface; this host has: {}",
                if spec.exclude { "^" } else { "" },
                if spec.exact { "=" } else { "" },
                spec.names.join(","),
                names.join(", ")
            ))
        });
    }
    match master {
        Some(m) if m.is_loopback() => Ok(m),
        Some(m) => route_to(m),
        None => {
            // The default route's interface, as the kernel would pick it for a distant address
            // (a documentation address: nothing is sent).
            if let Ok(ip) = route_to(IpAddr::from([192, 0, 2, 1])) {
                if !ip.is_loopback() && !ip.is_unspecified() {
                    return Ok(ip);
                }
            }
            let all = interfaces()?;
            Ok(all
                .iter()
                .find(|(n, ip)| {
                    ip.is_ipv4() && !ip.is_loopback() && !VIRTUAL.iter().any(|v| n.starts_with(v))
                })
                .map_or(IpAddr::from([127, 0, 0, 1]), |(_, ip)| *ip))
        }
    }
}

/// The local address the kernel would use to reach `dst` (a UDP connect sends nothing).
fn route_to(dst: IpAddr) -> Result<IpAddr> {
    let bind: SocketAddr =
        if dst.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    let sock = UdpSocket::bind(bind).map_err(|e| Error::io(usize::MAX, "route lookup", &e))?;
    sock.connect(SocketAddr::new(dst, 9))
        .map_err(|e| Error::Config(format!("no route from this host to MASTER_ADDR {dst}: {e}")))?;
    let ip = sock.local_addr().map_err(|e| Error::io(usize::MAX, "route lookup", &e))?.ip();
    Ok(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_syntax() {
        let s: IfSpec = "eth,ib".parse().unwrap();
        assert!(!s.exclude && !s.exact);
        assert!(s.matches("eth0") && s.matches("ib1") && !s.matches("lo"));
        let s: IfSpec = "^docker,lo".parse().unwrap();
        assert!(s.exclude && s.matches("eth0") && !s.matches("lo") && !s.matches("docker0"));
        let s: IfSpec = "=eth0".parse().unwrap();
        assert!(s.exact && s.matches("eth0") && !s.matches("eth01"));
        let s: IfSpec = "^=lo".parse().unwrap();
        assert!(s.exclude && s.exact && !s.matches("lo") && s.matches("lo2"));
        assert!("".parse::<IfSpec>().is_err());
        assert!("^".parse::<IfSpec>().is_err());
    }

    #[test]
    fn loopback_spec_and_unknown_interface() {
        let lo: IfSpec = "lo".parse().unwrap();
        assert!(select(Some(&lo), None).unwrap().is_loopback());
        let none: IfSpec = "=nosuchif0".parse().unwrap();
        let e = select(Some(&none), None).unwrap_err().to_string();
        assert!(e.contains("nosuchif0") && e.contains("lo"), "{e}");
    }

    #[test]
    fn loopback_master_means_loopback() {
        assert!(select(None, Some(IpAddr::from([127, 0, 0, 1]))).unwrap().is_loopback());
    }
}
