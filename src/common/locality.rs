//! How close a NIC is to this process: the PCI device's local CPU list (from sysfs)
//! against the CPU we run on. 0 = the NIC hangs off our socket, 1 = another one,
//! None = unknown (no PCI data, as with every software provider).

use crate::fabric::PciAddr;

/// Parse a sysfs CPU list such as `0-3,8,10-11`.
pub fn cpulist_contains(list: &str, cpu: u32) -> bool {
    list.trim()
        .split(',')
        .filter(|s| !s.is_empty())
        .any(|part| match part.split_once('-') {
            Some((a, b)) => match (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                (Ok(a), Ok(b)) => (a..=b).contains(&cpu),
                _ => false,
            },
            None => part.trim().parse::<u32>() == Ok(cpu),
        })
}

/// The locality callback handed to provider selection.
pub fn pci_distance(pci: &PciAddr) -> Option<u32> {
    let path = format!(
        "/sys/bus/pci/devices/{:04x}:{:02x}:{:02x}.{:x}/local_cpulist",
        pci.domain, pci.bus, pci.device, pci.function
    );
    let list = std::fs::read_to_string(path).ok()?;
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    if cpu < 0 {
        return None;
    }
    Some(if cpulist_contains(&list, cpu as u32) {
        0
    } else {
        1
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert!(cpulist_contains("0-3,8,10-11\n", 2));
        assert!(cpulist_contains("0-3,8,10-11", 8));
        assert!(cpulist_contains("0-3,8,10-11", 11));
        assert!(!cpulist_contains("0-3,8,10-11", 9));
        assert!(!cpulist_contains("", 0));
    }
}
