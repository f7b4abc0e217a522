//! What a pod process's executable says about the lane: statically linked
//! (no program interpreter, so the loader that honours `LD_PRELOAD` never
//! runs), a Go program (its runtime makes the socket system calls itself,
//! past libc, even when dynamically linked), or neither.
//!
//! The file belongs to a tenant. The scan opens it through `/proc/PID/exe`
//! (never by a path, which could lead into the host's file system) and
//! reads it only in bounded windows: the ELF header with the first bytes,
//! then the program and section header tables, the section names and the
//! notes where the headers put them, at most [`READ_BUDGET`] bytes in all.
//! `object` parses those windows; a header that points outside them, or
//! outside the file, is an error, never a larger read.

use std::ops::Range;

use object::elf;
use object::read::elf::{FileHeader, ProgramHeader, SectionHeader};
use object::{Endianness, FileKind, ReadRef};

/// The first window: the ELF header, and in practice the program headers,
/// the interpreter's path and the notes too.
const FIRST_WINDOW: u64 = 64 << 10;
/// Most bytes read from one file.
const READ_BUDGET: u64 = 2 << 20;
/// Most program headers looked at (real executables have about a dozen).
const MAX_PROGRAM_HEADERS: usize = 512;
/// Most section headers read (real executables have a few dozen).
const MAX_SECTIONS: usize = 4096;
/// Most bytes of one note segment, and of the section names, read.
const MAX_TABLE: u64 = 64 << 10;
/// Most notes looked at in all.
const MAX_NOTES: usize = 64;

/// The Go toolchain's build-id note (`cmd/link`: name "Go", type 4).
const GO_NOTE_NAME: &[u8] = b"Go";
const NT_GO_BUILD_ID: u32 = 4;
/// Sections only the Go linker makes (kept by `strip` and `-ldflags=-s -w`).
const GO_SECTIONS: [&[u8]; 3] = [b".go.buildinfo", b".note.go.buildid", b".gopclntab"];

/// What the executable is, as far as the lane cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExeFacts {
    /// No `PT_INTERP`: the dynamic loader (and with it `LD_PRELOAD`) never runs.
    pub is_static: bool,
    pub is_go: bool,
}

/// Why an executable was not classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExeError {
    NotElf,
    /// A header points outside the file, or past a bound; the text says which.
    Malformed(&'static str),
    Io,
}

/// Something to read at offsets: the opened executable, or bytes (tests).
pub trait Source {
    fn size(&self) -> u64;
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

impl Source for std::fs::File {
    fn size(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
}

impl Source for [u8] {
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| std::io::ErrorKind::UnexpectedEof)?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// The parts of a file read so far: what `object` parses. A read outside
/// them fails.
struct Windows<'s, S: Source + ?Sized> {
    source: &'s S,
    len: u64,
    parts: Vec<(u64, Vec<u8>)>,
    spent: u64,
}

impl<'s, S: Source + ?Sized> Windows<'s, S> {
    fn new(source: &'s S) -> Self {
        Windows {
            len: source.size(),
            source,
            parts: Vec::new(),
            spent: 0,
        }
    }

    fn find(&self, offset: u64, size: u64) -> Option<&[u8]> {
        let end = offset.checked_add(size)?;
        self.parts.iter().find_map(|(start, data)| {
            let a = usize::try_from(offset.checked_sub(*start)?).ok()?;
            let b = usize::try_from(end - start).ok()?;
            data.get(a..b)
        })
    }

    /// Reads `size` bytes at `offset` unless a window holds them already.
    fn ensure(&mut self, offset: u64, size: u64, what: &'static str) -> Result<(), ExeError> {
        if self.find(offset, size).is_some() {
            return Ok(());
        }
        let end = offset.checked_add(size).ok_or(ExeError::Malformed(what))?;
        if end > self.len || size > READ_BUDGET - self.spent {
            return Err(ExeError::Malformed(what));
        }
        let mut buf = vec![0; size as usize];
        self.source
            .read_exact_at(&mut buf, offset)
            .map_err(|_| ExeError::Io)?;
        self.spent += size;
        self.parts.push((offset, buf));
        Ok(())
    }
}

impl<'a, S: Source + ?Sized> ReadRef<'a> for &'a Windows<'_, S> {
    fn len(self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        self.find(offset, size).ok_or(())
    }

    fn read_bytes_at_until(self, range: Range<u64>, delimiter: u8) -> Result<&'a [u8], ()> {
        let (start, end) = (range.start, range.end);
        self.parts
            .iter()
            .find_map(|(s, data)| {
                let a = usize::try_from(start.checked_sub(*s)?).ok()?;
                let b = usize::try_from(end.checked_sub(*s)?)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                let hay = data.get(a..b)?;
                Some(hay.iter().position(|c| *c == delimiter).map(|i| &hay[..i]))
            })
            .flatten()
            .ok_or(())
    }
}

/// Classifies the executable `source` holds.
pub fn classify<S: Source + ?Sized>(source: &S) -> Result<ExeFacts, ExeError> {
    let mut w = Windows::new(source);
    w.ensure(0, w.len.min(FIRST_WINDOW), "header")?;
    match FileKind::parse(&w).map_err(|_| ExeError::NotElf)? {
        FileKind::Elf32 => classify_elf::<elf::FileHeader32<Endianness>, S>(&mut w),
        FileKind::Elf64 => classify_elf::<elf::FileHeader64<Endianness>, S>(&mut w),
        _ => Err(ExeError::NotElf),
    }
}

fn bad(what: &'static str) -> impl Fn(object::Error) -> ExeError {
    move |_| ExeError::Malformed(what)
}

fn classify_elf<Elf: FileHeader<Endian = Endianness>, S: Source + ?Sized>(
    w: &mut Windows<'_, S>,
) -> Result<ExeFacts, ExeError> {
    // Section 0 holds the real counts when the header's overflow.
    let (endian, shoff, shentsize, phoff, phentsize): (Endianness, u64, u64, u64, u64) = {
        let h = Elf::parse(&*w).map_err(bad("header"))?;
        let e = h.endian().map_err(bad("byte order"))?;
        (
            e,
            h.e_shoff(e).into(),
            u64::from(h.e_shentsize(e)),
            h.e_phoff(e).into(),
            u64::from(h.e_phentsize(e)),
        )
    };
    let has_sections = shoff != 0 && w.ensure(shoff, shentsize, "section 0").is_ok();
    // The program headers.
    let phnum = {
        let h = Elf::parse(&*w).map_err(bad("header"))?;
        h.phnum(endian, &*w).map_err(bad("program header count"))?
    };
    if phnum > MAX_PROGRAM_HEADERS {
        return Err(ExeError::Malformed("too many program headers"));
    }
    if phoff != 0 {
        w.ensure(phoff, phentsize * phnum as u64, "program headers")?;
    }
    let (has_interp, note_ranges) = {
        let h = Elf::parse(&*w).map_err(bad("header"))?;
        let phdrs = h
            .program_headers(endian, &*w)
            .map_err(bad("program headers"))?;
        let has_interp = phdrs.iter().any(|p| p.p_type(endian) == elf::PT_INTERP);
        let notes: Vec<(u64, u64)> = phdrs
            .iter()
            .filter(|p| p.p_type(endian) == elf::PT_NOTE)
            .map(|p| (p.p_offset(endian).into(), p.p_filesz(endian).into()))
            .filter(|(_, size)| *size <= MAX_TABLE)
            .take(16)
            .collect();
        (has_interp, notes)
    };
    // Notes: a segment that cannot be read is only no evidence.
    for (offset, size) in &note_ranges {
        let _ = w.ensure(*offset, *size, "note");
    }
    let mut is_go = go_note::<Elf, S>(&*w, endian)?;
    if !is_go && has_sections {
        is_go = go_section::<Elf, S>(w, endian).unwrap_or(false);
    }
    Ok(ExeFacts {
        is_static: !has_interp,
        is_go,
    })
}

/// Whether a note segment holds the Go build-id note.
fn go_note<Elf: FileHeader<Endian = Endianness>, S: Source + ?Sized>(
    w: &Windows<'_, S>,
    endian: Endianness,
) -> Result<bool, ExeError> {
    let h = Elf::parse(w).map_err(bad("header"))?;
    let phdrs = h
        .program_headers(endian, w)
        .map_err(bad("program headers"))?;
    let mut seen = 0;
    for p in phdrs.iter().filter(|p| p.p_type(endian) == elf::PT_NOTE) {
        let Ok(Some(mut notes)) = p.notes(endian, w) else {
            continue;
        };
        while let Ok(Some(n)) = notes.next() {
            if n.name() == GO_NOTE_NAME && n.n_type(endian) == NT_GO_BUILD_ID {
                return Ok(true);
            }
            seen += 1;
            if seen >= MAX_NOTES {
                return Ok(false);
            }
        }
    }
    Ok(false)
}

/// Whether a section only the Go linker makes is there.
fn go_section<Elf: FileHeader<Endian = Endianness>, S: Source + ?Sized>(
    w: &mut Windows<'_, S>,
    endian: Endianness,
) -> Result<bool, ExeError> {
    let (shoff, count, names): (u64, usize, u32) = {
        let h = Elf::parse(&*w).map_err(bad("header"))?;
        let count = h.shnum(endian, &*w).map_err(bad("section count"))?;
        let index = h.shstrndx(endian, &*w).map_err(bad("section names"))?;
        (h.e_shoff(endian).into(), count, index)
    };
    if count > MAX_SECTIONS {
        return Err(ExeError::Malformed("too many sections"));
    }
    let entry = std::mem::size_of::<Elf::SectionHeader>() as u64;
    w.ensure(shoff, entry * count as u64, "section headers")?;
    let names_range = {
        let h = Elf::parse(&*w).map_err(bad("header"))?;
        let sections = h
            .section_headers(endian, &*w)
            .map_err(bad("section headers"))?;
        sections
            .get(names as usize)
            .and_then(|s| s.file_range(endian))
            .ok_or(ExeError::Malformed("section names"))?
    };
    if names_range.1 > MAX_TABLE {
        return Err(ExeError::Malformed("section names too large"));
    }
    w.ensure(names_range.0, names_range.1, "section names")?;
    let h = Elf::parse(&*w).map_err(bad("header"))?;
    let table = h.sections(endian, &*w).map_err(bad("sections"))?;
    Ok(table.iter().any(|s| {
        table
            .section_name(endian, s)
            .is_ok_and(|n| GO_SECTIONS.contains(&n))
    }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::Cell;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Bytes that count what is read of them.
    struct Counting<'a> {
        data: &'a [u8],
        read: Cell<u64>,
    }

    impl Source for Counting<'_> {
        fn size(&self) -> u64 {
            self.data.len() as u64
        }
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.read.set(self.read.get() + buf.len() as u64);
            self.data.read_exact_at(buf, offset)
        }
    }

    fn classify_bytes(data: &[u8]) -> Result<ExeFacts, ExeError> {
        let c = Counting {
            data,
            read: Cell::new(0),
        };
        let r = classify(&c);
        assert!(c.read.get() <= READ_BUDGET, "read {} bytes", c.read.get());
        r
    }

    /// A fresh directory for built programs.
    pub(crate) fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fld-exe-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Runs a build command; a missing compiler fails the test.
    fn build(cmd: &mut Command) {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e} (install-deps installs gcc and golang-go)"));
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn c_program(dir: &Path, flags: &[&str]) -> PathBuf {
        let src = dir.join("p.c");
        std::fs::write(&src, "int main(void) { return 0; }\n").unwrap();
        let out = dir.join(format!("p{}", flags.join("")));
        build(
            Command::new("gcc")
                .args(flags)
                .arg("-o")
                .arg(&out)
                .arg(&src),
        );
        out
    }

    /// A Go program that imports `net` (with cgo it links libc
    /// dynamically), built offline with a cache of its own.
    pub(crate) fn go_program(dir: &Path, cgo: bool, ldflags: &str) -> PathBuf {
        let src = dir.join("main.go");
        std::fs::write(
            &src,
            "package main\nimport (\"fmt\"; \"net\")\nfunc main() { fmt.Println(net.IPv4len) }\n",
        )
        .unwrap();
        let out = dir.join(format!("go-cgo{cgo}{}", ldflags.replace(' ', "")));
        build(
            Command::new("go")
                .args(["build", "-ldflags", ldflags, "-o"])
                .arg(&out)
                .arg(&src)
                .current_dir(dir)
                .env(
                    "GOCACHE",
                    std::env::temp_dir().join("flowlane-test-gocache"),
                )
                .env("GOPATH", dir.join("gopath"))
                .env("GOPROXY", "off")
                .env("GO111MODULE", "off")
                .env("CGO_ENABLED", if cgo { "1" } else { "0" }),
        );
        out
    }

    fn classify_file(p: &Path) -> Result<ExeFacts, ExeError> {
        classify(&std::fs::File::open(p).unwrap())
    }

    #[test]
    fn real_programs_are_told_apart() {
        let dir = scratch("real");
        let me = classify_file(Path::new("/proc/self/exe")).unwrap();
        assert_eq!(
            me,
            ExeFacts {
                is_static: false,
                is_go: false
            }
        );
        let dynamic = c_program(&dir, &[]);
        assert!(!classify_file(&dynamic).unwrap().is_static);
        let fixed = c_program(&dir, &["-static"]);
        assert_eq!(
            classify_file(&fixed).unwrap(),
            ExeFacts {
                is_static: true,
                is_go: false
            }
        );
        let pie = c_program(&dir, &["-static-pie"]);
        assert!(
            classify_file(&pie).unwrap().is_static,
            "static-pie has no interpreter"
        );
        // Go: static without cgo, dynamic with it, also stripped.
        let go_static = go_program(&dir, false, "");
        assert_eq!(
            classify_file(&go_static).unwrap(),
            ExeFacts {
                is_static: true,
                is_go: true
            }
        );
        let go_dynamic = go_program(&dir, true, "");
        assert_eq!(
            classify_file(&go_dynamic).unwrap(),
            ExeFacts {
                is_static: false,
                is_go: true
            }
        );
        let go_stripped = go_program(&dir, false, "-s -w");
        assert!(classify_file(&go_stripped).unwrap().is_go);
        // Without its notes, the sections still say Go.
        let bytes = std::fs::read(&go_static).unwrap();
        let no_notes = strip_program_headers_of_type(&bytes, elf::PT_NOTE);
        assert!(classify_bytes(&no_notes).unwrap().is_go);
        // Without its section table, the note still says Go.
        let mut no_sections = bytes.clone();
        no_sections[40..48].copy_from_slice(&0u64.to_le_bytes());
        assert!(classify_bytes(&no_sections).unwrap().is_go);
        // Neither: not Go (and no panic).
        let mut neither = no_notes.clone();
        neither[40..48].copy_from_slice(&0u64.to_le_bytes());
        assert!(!classify_bytes(&neither).unwrap().is_go);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A copy of a 64-bit little-endian ELF whose program headers of `kind`
    /// are turned into PT_NULL.
    fn strip_program_headers_of_type(bytes: &[u8], kind: u32) -> Vec<u8> {
        let mut b = bytes.to_vec();
        let phoff = u64::from_le_bytes(b[32..40].try_into().unwrap()) as usize;
        let phnum = u16::from_le_bytes(b[56..58].try_into().unwrap()) as usize;
        for i in 0..phnum {
            let at = phoff + i * 56;
            if u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) == kind {
                b[at..at + 4].copy_from_slice(&elf::PT_NULL.to_le_bytes());
            }
        }
        b
    }

    #[test]
    fn hostile_files_are_refused_without_panic_or_big_reads() {
        let me = std::fs::read("/proc/self/exe").unwrap();
        assert_eq!(classify_bytes(b""), Err(ExeError::NotElf));
        assert_eq!(
            classify_bytes(b"#!/bin/sh\necho hi\n"),
            Err(ExeError::NotElf)
        );
        assert_eq!(classify_bytes(&[0u8; 4096]), Err(ExeError::NotElf));
        // Truncated: the header only, half of it.
        assert!(classify_bytes(&me[..32]).is_err());
        // Program headers out of the file, and too many of them.
        let mut far = me.clone();
        far[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(classify_bytes(&far).is_err());
        let mut many = me.clone();
        many[56..58].copy_from_slice(&0xfffeu16.to_le_bytes());
        assert_eq!(
            classify_bytes(&many),
            Err(ExeError::Malformed("too many program headers"))
        );
        // Huge section counts (extended numbering: section 0's size) and a
        // section table past the end: no section evidence, still classified.
        let mut huge = me.clone();
        let shoff = u64::from_le_bytes(huge[40..48].try_into().unwrap()) as usize;
        huge[60..62].copy_from_slice(&0u16.to_le_bytes());
        huge[shoff + 32..shoff + 40].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(!classify_bytes(&huge).unwrap().is_static);
        let mut past = me.clone();
        past[40..48].copy_from_slice(&((me.len() as u64) - 8).to_le_bytes());
        assert!(!classify_bytes(&past).unwrap().is_static);
        // Every byte of the headers flipped in turn, and random garbage in
        // them: never a panic, never more than the budget read.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut b = me.clone();
        for i in 0..4096.min(me.len()) {
            b[i] ^= 0xff;
            let _ = classify_bytes(&b);
            b[i] ^= 0xff;
        }
        for _ in 0..2000 {
            let mut b = me[..(next() as usize % 8192).max(1)].to_vec();
            for _ in 0..8 {
                let at = next() as usize % b.len();
                b[at] = next() as u8;
            }
            let _ = classify_bytes(&b);
        }
    }
}
