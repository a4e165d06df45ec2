//! Markdown for the site: CommonMark (with tables) to HTML, and text from the data made safe to
//! splice into Markdown. Used by the prose ([`super::prose`]) and the renderer
//! ([`super::render`]) alike, so neither imports the other.

/// CommonMark (with tables) to HTML.
pub fn to_html(md: &str) -> String {
    let parser = pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES);
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, parser);
    html
}

/// CommonMark (with tables) to HTML, every heading given an id from its text (`v3 — two
/// 16-row groups` gets `v3-two-16-row-groups`, repeats numbered), and the headings as
/// (id, text, level), in order.
pub fn to_html_with_ids(md: &str) -> (String, Vec<(String, String, u8)>) {
    use pulldown_cmark::{Event, Tag, TagEnd};
    let options = pulldown_cmark::Options::ENABLE_TABLES;
    // First pass: each heading's text.
    let mut headings: Vec<(String, String, u8)> = Vec::new();
    let mut current: Option<(String, u8)> = None;
    for event in pulldown_cmark::Parser::new_ext(md, options) {
        match event {
            Event::Start(Tag::Heading { level, .. }) => {
                current = Some((String::new(), level as u8))
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some((text, _)) = current.as_mut() {
                    text.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some((text, level)) = current.take() {
                    headings.push((String::new(), text, level));
                }
            }
            _ => {}
        }
    }
    let mut used: Vec<String> = Vec::new();
    for h in &mut headings {
        let base = slug(&h.1);
        let mut id = base.clone();
        let mut n = 1;
        while used.contains(&id) {
            n += 1;
            id = format!("{base}-{n}");
        }
        used.push(id.clone());
        h.0 = id;
    }
    // Second pass: the same events with the ids set.
    let mut next = headings.iter();
    let events = pulldown_cmark::Parser::new_ext(md, options).map(|event| match event {
        Event::Start(Tag::Heading {
            level,
            classes,
            attrs,
            ..
        }) => Event::Start(Tag::Heading {
            level,
            id: next.next().map(|h| h.0.clone().into()),
            classes,
            attrs,
        }),
        other => other,
    });
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, events);
    (html, headings)
}

/// Lower-case letters and digits of `text`, runs of anything else as one `-` (`section` when
/// nothing is left): heading anchors, and the Hopper page's per-card anchors and figure names.
pub fn slug(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() {
            out.extend(c.to_lowercase());
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    let out = out.trim_end_matches('-').to_string();
    if out.is_empty() {
        "section".to_string()
    } else {
        out
    }
}

/// Text from data made safe to splice into Markdown: HTML-escaped (pulldown-cmark passes raw
/// HTML through) and with Markdown's punctuation backslash-escaped.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '#' | '|' | '!' | '{' | '}' => {
                out.push('\\');
                out.push(ch);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_get_unique_ids() {
        let (html, h) = to_html_with_ids("# Notes\n\n## v1 — `mma.sync`\n\n## v1 — mma.sync\n");
        assert_eq!(h[1].0, "v1-mma-sync");
        assert_eq!(h[2].0, "v1-mma-sync-2");
        assert_eq!(h[1].2, 2);
        assert!(html.contains("<h2 id=\"v1-mma-sync\">"), "{html}");
    }

    #[test]
    fn escaped_text_renders_as_itself() {
        let raw = "a_b *c* <script> [x](y) | `z`";
        let html = to_html(&escape(raw));
        assert_eq!(
            html.trim(),
            "<p>a_b *c* &lt;script&gt; [x](y) | `z`</p>",
            "{html}"
        );
    }
}
